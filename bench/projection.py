"""PROJECTION (not a measurement): Muon's overhead per step under DistOpt at scale.

    .venv/bin/python bench/projection.py                 # markdown table, default assumptions
    .venv/bin/python bench/projection.py --mfu 0.3 --exchange-bytes 2 --tp-mode distributed

It models the schedule the optimizer executes, with the optimizer's own planning code:

* layout: Megatron DDP's buffer for the first pipeline stage (``ddp_layout``): params in the
  order DDP registers them (``named_parameters`` of a Llama-style GPTModel, local spec,
  iterated in reverse), starts padded to 64 elements, buckets closed once they reach DDP's
  ``bucket_size = max(40M, 1M * dp)`` (``--overlap-grad-reduce``; one bucket without it) and
  padded to ``lcm(dp, 128)``; TP-local shapes (QKV, fc1 split by rows, proj, fc2 by columns);
* our layout: the one the optimizer takes (``ours_layout``: ``MuonDistributedOptimizer.
  compute_full_param_layout``, layout.py's decision, on meta tensors): shard-aligned where
  the holders' loads balance and its padding is under the ``M / dp`` Muon elements a rank's
  exchange would move (upstream's LayerWise layout for the matrices: the exchange moves
  the few matrices ``holder_owners`` moves, skipped all-to-alls are no sync point, and its
  padded buffers cost the same extra grad reduce-scatter and param all-gather as LayerWise's),
  else the byte-level buffer above; each row says which;
* the plan: megatron_muon/planner/plan.py's ``MuonExchangePlan`` on those buckets, costs from its
  ``tp_ns_cost`` for the TP mode (owners, exchanges, pieces as on a real run; a test ties this
  layout to a real DDP buffer and the plan to the optimizer's);
* Newton-Schulz time = every rank's trace (planner/figures.py's ``trace``: its gang blocks
  interleaved, their collectives posted async, then its whole matrices) run by
  ``cost_model.critical_path`` (``ns_seconds``): matmuls at peak * mfu, gang collectives at the
  links' bandwidth (plus ``--step-latency-us`` per ring step); exchange time = per exchange and
  direction, the busiest rank's max(sent, received) bytes / link (full duplex), forward in the NS
  dtype's width where narrower.

* TP time: every TP collective the TP mode issues (``planner/figures.py``'s ``tp_schedule``,
  ``planner/plan.py``'s ``tp_collectives``; tests/distributed/test_muon_tp_collectives.py ties
  the count to a real TP 2 step): ``duplicated``'s all-gather of each owned matrix (and gang
  block) over TP before Newton-Schulz, ``distributed``'s per block norm all-reduce and, per NS
  step, the packed Gram's sum (in a NS dtype narrower than fp32 its partials' all-to-all and
  the sums' all-gather in it, ``tp.sums_in``; else an fp32 all-reduce) and the all-gather of
  the polynomial's pieces,
  ``blockwise``'s none; at ``--tp-link-gbps`` (NVLink, 450 GB/s per direction as the planner's
  ``PlanLinks``), ring bytes each way, on the owner's main thread (no overlap), so it lies on the
  critical path where it runs; ``distributed``'s as its stream posts and waits for them
  (``figures.stream_trace``: two matrices in flight, one's collectives under the other's
  matmuls). The TP collectives around a sliced gang collective (``NSCostModel.tp_around``: a
  partial sum's reduce-scatter before its post, the all-gather of the slices after its wait) run
  on the main thread, where gangs.py runs them.

Per GPU and step: model = 6 N tokens / (gpus * peak * mfu). Baseline (gather-everything): every
rank orthogonalizes every matrix in the TP mode (its FLOPs and TP collectives) and all-gathers
M (dp-1)/dp bytes. LayerWise: each rank's owned matrices in the same TP mode, counted alike
(``distributed``: upstream's, every block split, one matrix at a time). No
overlap of Muon with the model's work (an upper bound on the visible overhead), no latency terms
unless asked for.
"""

import argparse
import dataclasses
import math
from collections import Counter
from typing import Optional

import torch
from megatron.core.distributed import DistributedDataParallelConfig

from megatron.core.optimizer.megatron_muon.distrib_optimizer import MuonDistributedOptimizer
from megatron.core.optimizer.megatron_muon.exchange import BucketSlot, MatrixSlot, exchange_dtypes
from megatron.core.optimizer.megatron_muon.factory import MegatronMuonParamInfo
from megatron.core.optimizer.megatron_muon.planner import figures as plan_figures
from megatron.core.optimizer.megatron_muon.planner.cost_model import (
    ALL,
    NSCostModel,
    PlanLinks,
    arrival_times,
    critical_path,
    streamed,
)
from megatron.core.optimizer.megatron_muon.planner.plan import (
    MuonExchangePlan,
    TPCollective,
    owner_collectives,
    owner_stream,
    tp_collectives,
    tp_ns_cost,
)
from megatron.core.optimizer.megatron_muon.tp import owner_cells

# name: (layers, hidden, ffn, heads, kv heads, vocab, tp); Llama 3.2 1B, Llama 3 8B / 70B shapes.
MODELS = {
    "1B": (16, 2048, 8192, 32, 8, 128256, 1),
    "8B": (32, 4096, 14336, 32, 8, 128256, 1),
    "70B": (80, 8192, 28672, 64, 8, 128256, 8),
}
DPS = (8, 64, 256, 1024)
NS_STEPS = 5
# NVLink per GPU and direction, Gb/s (450 GB/s, H100 SXM; the planner's ``PlanLinks`` default).
NVLINK_GBPS = 3600.0


def model_params(layers, hidden, ffn, heads, kv, vocab, tp) -> list[tuple]:
    """(name, TP-local shape, TP-global Muon info or None) in ``named_parameters`` order."""
    head_dim = hidden // heads
    qkv_rows = (heads + 2 * kv) * head_dim
    qkv_split = (heads // kv * head_dim, head_dim, head_dim)

    def muon(rows, cols, dim, split=None):
        local = (rows // tp, cols) if dim == 0 else (rows, cols // tp)
        return local, MegatronMuonParamInfo((rows, cols), split, partition_dim=dim)

    out = [("embedding.word_embeddings.weight", (vocab // tp, hidden), None)]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,), None),
            (p + "self_attention.linear_proj.weight", *muon(hidden, hidden, 1)),
            (p + "self_attention.linear_qkv.weight", *muon(qkv_rows, hidden, 0, qkv_split)),
            (p + "pre_mlp_layernorm.weight", (hidden,), None),
            (p + "mlp.linear_fc1.weight", *muon(2 * ffn, hidden, 0)),
            (p + "mlp.linear_fc2.weight", *muon(hidden, ffn, 1)),
        ]
    out += [("decoder.final_layernorm.weight", (hidden,), None)]
    return out + [("output_layer.weight", (vocab // tp, hidden), None)]


def ddp_bucket_size(dp: int, overlap_grad_reduce: bool = True):
    """DistributedDataParallel's rule (megatron-core 0.16.1) when ``bucket_size`` is not given."""
    return max(40_000_000, 1_000_000 * dp) if overlap_grad_reduce else None


def ddp_layout(numels: list[int], dp: int, bucket_size) -> list[tuple[int, int, dict]]:
    """Buckets (start, end, {param index: (start, end)}) of DDP's buffer with DistOpt, as
    ``_ParamAndGradBuffer`` builds it: params in reverse order, starts padded to 64 elements, a
    bucket closed once it holds >= ``bucket_size`` elements, ends padded to lcm(dp, 128)."""
    pad = math.lcm(dp, 128)
    buckets, current, bucket_start, at = [], {}, 0, 0
    for i in reversed(range(len(numels))):
        start = -(-at // 64) * 64
        current[i], at = (start, start + numels[i]), start + numels[i]
        if bucket_size is not None and at - bucket_start >= bucket_size:
            end = -(-at // pad) * pad
            buckets.append((bucket_start, end, current))
            current, bucket_start, at = {}, end, end
    if current:
        buckets.append((bucket_start, -(-at // pad) * pad, current))
    return buckets


# LayerWiseDistributedOptimizer._compute_per_buffer_param_layout's constant (megatron-core 0.19.2)
LAYER_WISE_PADDING_FLOOR = 0.9


def layer_wise_layout(numels: list[int], dp: int, bucket_size) -> dict:
    """Upstream's LayerWise layout rule (``LayerWiseDistributedOptimizer.
    _compute_per_buffer_param_layout``, megatron-core 0.19.2) for the buffer of the Muon matrices
    (``numels`` in ``named_parameters`` order): params walked in reverse into chunks, a chunk
    closed once it holds >= ``max(bucket_size, int(dp * its largest param * 0.9))`` elements
    (all in one without ``bucket_size``); each chunk bin-packed whole into ``dp`` shards (LPT:
    largest first, stable, onto the least-filled shard, starts padded to 64 elements); every
    shard padded to the fullest one, rounded up to ``lcm(64, lcm(dp, 128) / dp)``; shard ``s``
    of a bucket is DP rank ``s``'s (``shard_params``). Returns ``index`` {param: (start, end,
    bucket, owner)}, ``buckets`` [(start, end)], ``numel`` (the padded buffer) and ``padding``."""
    divisor = math.lcm(64, math.lcm(dp, 128) // dp)
    pad64 = lambda n: -(-n // 64) * 64  # noqa: E731
    index, buckets = {}, []

    def emit(chunk: list[int]) -> None:
        if not chunk:
            return
        shards, cursors = [[] for _ in range(dp)], [0] * dp
        for i in sorted(chunk, key=lambda i: -numels[i]):
            s = min(range(dp), key=lambda s: cursors[s])
            shards[s].append(i)
            cursors[s] = pad64(cursors[s]) + numels[i]
        shard = -(-max(cursors) // divisor) * divisor
        start = buckets[-1][1] if buckets else 0
        for s, members in enumerate(shards):
            at = start + s * shard
            for i in members:
                at = pad64(at)
                index[i] = (at, at + numels[i], len(buckets), s)
                at += numels[i]
        buckets.append((start, start + dp * shard))

    chunk, held, largest = [], 0, 0
    for i in reversed(range(len(numels))):
        chunk.append(i)
        held, largest = held + numels[i], max(largest, numels[i])
        if bucket_size is not None:
            if held >= max(bucket_size, int(dp * largest * LAYER_WISE_PADDING_FLOOR)):
                emit(chunk)
                chunk, held, largest = [], 0, 0
    emit(chunk)
    numel = buckets[-1][1] if buckets else 0
    return {"index": index, "buckets": buckets, "numel": numel, "padding": numel - sum(numels)}


def layer_wise(
    params: list[tuple],
    dp: int,
    bucket_size,
    model: NSCostModel,
    tp_link: float = math.inf,
    gather: bool = False,
) -> dict:
    """Upstream's LayerWise Muon on this model, from its layout: the matrices (``info`` set; the
    params ``is_managed_by_layer_wise_optimizer`` marks: 2-D, not embedding or output) in a
    buffer of their own (``layer_wise_layout``), everything else in a DistOpt-style buffer
    (``ddp_layout``). Each DP rank runs Newton-Schulz on the whole matrices of its shards
    (``model.whole``: the TP mode's FLOPs per TP rank) and the TP mode's collectives
    (``matrix_tp_bytes`` at ``tp_link`` bytes/s; upstream's ``distributed`` mode gathers no block:
    ``gather``, and ``model.whole`` must agree). Returns per-rank NS FLOPs and TP seconds, the
    owner of each matrix, and both buffers' padded sizes (elements per TP rank)."""
    muon = [i for i, (_, _, info) in enumerate(params) if info is not None]
    rest = [i for i, (_, _, info) in enumerate(params) if info is None]
    numel = lambda i: math.prod(params[i][1])  # noqa: E731
    lw = layer_wise_layout([numel(i) for i in muon], dp, bucket_size)
    flops, tp_seconds = [0.0] * dp, [0.0] * dp
    owner = {}
    for k, i in enumerate(muon):
        rank = lw["index"][k][3]
        owner[params[i][0]] = rank
        flops[rank] += model.whole(params[i][2])
        tp_seconds[rank] += matrix_tp_bytes(model, params[i][2], gather) / tp_link
    other = ddp_layout([numel(i) for i in rest], dp, bucket_size)
    return {
        "flops": flops,
        "tp_seconds": tp_seconds,
        "owner": owner,
        "layout": lw,
        "numel": lw["numel"] + (other[-1][1] if other else 0),
        "matrix_numel": lw["numel"] - lw["padding"],
    }


def byte_level(params: list[tuple], dp: int, bucket_size) -> list:
    """DDP's byte-level buffer (``ddp_layout``) of every param: DistOpt's layout."""
    return ddp_layout([math.prod(shape) for _, shape, _ in params], dp, bucket_size)


def ours_layout(params: list[tuple], dp: int, bucket_size) -> tuple[bool, list]:
    """The layout our optimizer takes: ``MuonDistributedOptimizer.compute_full_param_layout``
    (layout.py's decision, upstream's rules) run on meta tensors of the TP-local shapes.
    Returns (shard-aligned, buckets, padded elements of all buffers) with buckets as
    ``ddp_layout``'s, of every buffer in turn (positions within its own buffer)."""
    metas = []
    for _, shape, info in params:
        metas.append(torch.nn.Parameter(torch.empty(shape, device="meta")))
        metas[-1].is_embedding_or_output_parameter = len(shape) == 2 and info is None
    config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    full = MuonDistributedOptimizer.compute_full_param_layout(metas, bucket_size, dp, config)
    at = {id(p): i for i, p in enumerate(metas)}
    buckets = []
    for per in full.layouts.values():
        members = [{} for _ in per.bucket_indices]
        for p, (start, end, b) in per.param_index_map.items():
            members[b][at[id(p)]] = (start, end)
        buckets += [(lo, hi, m) for (lo, hi), m in zip(per.bucket_indices, members)]
    aligned = any(key.is_managed_by_layer_wise_optimizer for key in full.layouts)
    numel = sum(per.bucket_indices[-1][1] for per in full.layouts.values() if per.bucket_indices)
    return aligned, buckets, numel


def build_plan(params: list[tuple], buckets: list, dp: int, model: NSCostModel, window=None):
    """The optimizer's plan (rank 0's view; figures cover every rank) for a layout's
    ``buckets`` (``ddp_layout`` or ``ours_layout``)."""
    slots, matrices = [], []
    for start, end, members in buckets:
        slot = BucketSlot(group=None, shard_size=(end - start) // dp)
        for i in sorted(members, reverse=True):  # DDP's bucket.params_list: reverse order
            name, shape, info = params[i]
            if info is None:
                continue
            lo, hi = members[i]
            slot.matrices.append(len(matrices))
            cost = model.whole(info)
            matrices.append(MatrixSlot(name, len(slots), lo - start, hi - start, shape, info, cost))
        slot.matrices.sort(key=lambda i: matrices[i].start)
        slots.append(slot)
    return MuonExchangePlan(slots, matrices, 0, dp, window, model)


def cost_model(tp: int, mode: str, steps: int = NS_STEPS, **link) -> NSCostModel:
    """The optimizer's NS cost model for a TP size and mode (Muon params are all TP-sharded);
    ``link``: ``link_flops_per_byte`` and ``ns_itemsize`` for the planner's choice."""
    tp_of = lambda info: tp if info.partition_dim is not None else 1  # noqa: E731
    whole = lambda info: tp_ns_cost(info, steps, mode, tp_of(info))  # noqa: E731
    stream = owner_stream if mode == "distributed" else None  # as plan.ns_cost_model
    return NSCostModel(steps, whole, tp_of, mode, stream=stream, **link)


def exchange_seconds(plan: MuonExchangePlan, forward_bytes: int, return_bytes: int, link: float):
    """Per exchange and direction, the busiest rank's max(sent, received) over a duplex link."""
    total = 0.0
    for ex in plan.exchanges:
        sent, received = plan_figures.traffic(plan, ex)
        busiest = max(max(s, r) for s, r in zip(sent, received))
        total += busiest * (forward_bytes + return_bytes) / link
    return total


def ns_seconds(
    plan: MuonExchangePlan,
    rate: float,
    link: float,
    tp_link: float,
    latency: float = 0.0,
    tp: bool = True,
    tp_model: Optional[NSCostModel] = None,
) -> float:
    """The plan's NS critical path in seconds: matmuls at ``rate``, each gang collective as a
    ring over a duplex link (``NSCostModel.ring_bytes``: a fp32 sum ``2 (k - 1) / k`` of the
    tensor each way, a gather of polynomial rows ``(k - 1) / k`` in the NS dtype; ``1 / tp`` of it
    per TP rank where TP ranks share the block), plus ``latency`` seconds per dependent ring step
    (``NSCostModel.ring_steps``); the TP collectives around it (``NSCostModel.tp_around``: a
    partial sum's reduce-scatter before the post, the all-gather of the slices after the wait)
    on the main thread, at ``tp_link`` plus ``latency`` each, as gangs.py runs them; plus (``tp``)
    the TP mode's own collectives at ``tp_link`` where the owner's main thread runs them
    (``with_tp``; counted with ``tp_model``, default the plan's)."""
    return critical_path(*_ns_schedule(plan, rate, link, tp_link, latency, tp, tp_model))


def rank_ends(plan: MuonExchangePlan, rate: float, link: float, tp_link: float, latency=0.0):
    """Per DP rank, when its main thread reaches the return all-to-all in ``ns_seconds``' run
    (``cost_model.arrival_times``): its own NS, TP and gang time; the latest is ``ns_seconds``."""
    return arrival_times(*_ns_schedule(plan, rate, link, tp_link, latency, True, None))


def _ns_schedule(plan, rate, link, tp_link, latency, tp, tp_model) -> tuple:
    """``ns_seconds``' traces, work, sync and busy, for ``critical_path``."""
    traces = [plan_figures.trace(plan, r) for r in range(plan.world)]
    if tp:
        traces = with_tp(plan, traces, rate / tp_link, tp_model or plan.model)

    def ring(members: tuple, elements) -> float:
        if isinstance(elements, TPCollective):  # a TP collective of the distributed mode
            return elements.link_bytes() / tp_link
        if not elements:
            return 0.0
        slow, fast = plan.model.ring_bytes(members, elements)
        steps = plan.model.ring_steps(members, elements) * latency
        return slow / link + fast / tp_link + steps

    def busy(elements) -> tuple[float, float]:
        if isinstance(elements, TPCollective) or not elements:
            return 0.0, 0.0
        sides = plan.model.tp_around(elements)
        return tuple(sum(c.link_bytes() / tp_link + latency for c in side) for side in sides)

    return traces, lambda flops: flops / rate, ring, busy


def by_rank(plan: MuonExchangePlan, ends: list[float], rate: float) -> list[dict]:
    """The DP ranks grouped by what they orthogonalize (``fc1/3``: a block of a gang of 3),
    latest end first: how many, the most matmul time and the latest end (``rank_ends``)."""
    kinds: dict[int, list[str]] = {r: [] for r in range(plan.world)}
    flops = [0.0] * plan.world
    for m in plan.matrices:
        name = m.name.split(".")[-2].removeprefix("linear_")
        for u in m.units:
            kinds[u.owner].append(name + (f"/{len(u.gang)}" if u.gang else ""))
            flops[u.owner] += u.cost
    groups: dict[str, list[int]] = {}
    for r, names in kinds.items():
        counts = sorted(Counter(names).items())
        key = ", ".join(f"{n} {name}" for name, n in counts) or "nothing"
        groups.setdefault(key, []).append(r)
    rows = [
        {
            "kind": key,
            "ranks": len(ranks),
            "matmuls": max(flops[r] for r in ranks) / rate,
            "end": max(ends[r] for r in ranks),
        }
        for key, ranks in groups.items()
    ]
    return sorted(rows, key=lambda row: (-row["end"], row["kind"]))


def by_rank_markdown(model: str, dp: int, rows: list[dict]) -> str:
    """``by_rank``'s rows of one projection row as a table."""
    lines = [
        f"\n{model} at DP {dp}, the DP ranks by what they orthogonalize (when each reaches the "
        "return all-to-all):\n",
        "| ranks orthogonalize | ranks | matmuls (busiest) | ends (latest) | TP and gang time |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        gap = r["end"] - r["matmuls"]
        lines.append(
            f"| {r['kind']} | {r['ranks']} | {_ms(r['matmuls'])} | {_ms(r['end'])} | {_ms(gap)} |"
        )
    return "\n".join(lines)


def matrix_tp_bytes(model: NSCostModel, info, gather: bool = True) -> float:
    """Bytes each way one TP rank moves over the TP link to orthogonalize ``info`` whole in the
    model's TP mode (``plan.tp_collectives``; ``gather``: as there)."""
    ns_dtype = plan_figures.NS_DTYPES[model.ns_itemsize]
    tp = model.tp_of(info)
    found = tp_collectives(info, model.steps, model.mode, tp, ns_dtype, gather=gather)
    return sum(c.link_bytes() for c in found)


def with_tp(plan: MuonExchangePlan, traces: list, flops_per_byte: float, model) -> list:
    """``traces`` with each rank's TP collectives (``figures.tp_schedule`` with ``model``) where
    the step runs them: the gang blocks' TP all-gathers as main-thread time (bytes each way x
    ``flops_per_byte``, FLOP units) before the first gang work after the forward all-to-all;
    the whole matrices' before the return all-to-all, as main-thread time too, or (the
    ``distributed`` mode, tp.py's ``stream``) as the collectives it posts and waits for
    (``cost_model.streamed``), each one TP rank's ``link_bytes`` on a link of its own."""
    out = []
    for rank, trace in enumerate(traces):
        trace = list(trace)
        alls = [i for i, e in enumerate(trace) if e[1] == ALL]
        for ex, fwd, back in reversed(list(zip(plan.exchanges, alls[::2], alls[1::2]))):
            gathered, _, whole = plan_figures.tp_schedule(plan, ex, rank, model=model)
            f, *rest = trace[back]
            if model.mode == "distributed":  # tp.py's stream, in the order the owner runs it
                owned = [plan.matrices[i] for i in plan_figures.owned_whole(plan, ex, rank)]
                run = [(m.info, m.units[0].cost) for m in owned]
                trace[back : back + 1] = streamed(rank, run, (f, *rest), model, owner_stream)
            else:
                trace[back] = (f + flops_per_byte * sum(c.link_bytes() for c in whole), *rest)
            f, *rest = trace[fwd + 1]
            trace[fwd + 1] = (f + flops_per_byte * sum(c.link_bytes() for c in gathered), *rest)
        out.append(trace)
    return out


def owner_ns(plan: MuonExchangePlan, rate: float, tp_link: float, tp: int) -> dict:
    """The ``owner`` TP mode's NS figures of ``plan`` (TP-sharded matrices, no gangs): each DP
    owner's matrices spread over its TP ranks as tp.py's ``owner_cells`` does; the busiest TP
    rank's NS FLOPs plus its two TP all-to-alls (``owner_collectives``) at ``tp_link``."""
    assert not any(ex.gangs for ex in plan.exchanges), "owner mode: TP-sharded matrices whole"
    flops, seconds = 0.0, 0.0
    for r in range(plan.world):
        owned = [m for m in plan.matrices if m.owner == r]
        infos = [m.info for m in owned]
        cells = owner_cells(infos, tp)
        for t in range(tp):
            load = sum(m.cost * tp for m, c in zip(owned, cells) if c == t)
            moved = sum(c.link_bytes() for c in owner_collectives(infos, tp, t)) / tp_link
            flops, seconds = max(flops, load), max(seconds, load / rate + moved)
    ideal = sum(m.cost for m in plan.matrices) / plan.world
    return {"ns": seconds, "ns_flops": flops / rate, "efficiency": ideal / flops if flops else 1.0}


def with_owner(row: dict, plans: dict, rate: float, tp_link: float, tp: int) -> dict:
    """``row`` with the ``owner`` mode's NS figures of each of its plans (``owner_ns``)."""
    for key, plan in plans.items():
        if not plan:
            continue
        got = owner_ns(plan, rate, tp_link, tp)
        if key == "":
            row.update(ns=got["ns"], ns_no_tp=got["ns_flops"], ns_flops=got["ns_flops"])
            row["efficiency"] = got["efficiency"]
        elif key == "unsplit":
            row.update(unsplit_ns=got["ns_flops"], unsplit_tp=got["ns"] - got["ns_flops"])
            row["unsplit_efficiency"] = got["efficiency"]
        else:
            row[f"{key}_ns"], row[f"{key}_ns_flops"] = got["ns"], got["ns_flops"]
            row[f"{key}_efficiency"] = got["efficiency"]
    return row


def project(model: str, dp: int, a) -> dict:
    cfg = MODELS[model]
    tp = cfg[-1]
    params = model_params(*cfg)
    infos = [info for _, _, info in params if info is not None]
    total = sum(math.prod(shape) * (tp if len(shape) == 2 else 1) for _, shape, _ in params)
    rate, link = a.peak_tflops * 1e12 * a.mfu, a.link_gbps / 8 * 1e9
    tp_link, latency = a.tp_link_gbps / 8 * 1e9, a.step_latency_us * 1e-6
    forward, back = wire_bytes(a)
    links = PlanLinks(rate / 1e12, a.link_gbps, a.tp_link_gbps)  # what --muon-plan-* would say
    link_model = cost_model(
        tp,
        a.tp_mode,
        **links.link_costs(),
        ns_itemsize=a.ns_bytes,
        exchange_itemsizes=forward + back,
        nodes=tuple(r // max(1, a.gpus_per_node // tp) for r in range(dp)),
        step_latency_flops=rate * latency,
    )
    bucket = ddp_bucket_size(dp, not a.one_bucket)
    aligned, buckets, ours_numel = ours_layout(params, dp, bucket)
    plan = build_plan(params, buckets, dp, link_model)
    unsplit = plan.rebuilt(model=None)  # one owner per matrix, same layout and exchange
    # The plan a planner blind to the link would choose: shortest FLOP critical path.
    flop_only = plan.rebuilt(model=link_model.free_links())
    # The fastest plan at least a.min_efficiency balanced (--muon-plan-min-efficiency); 0: none.
    floor = a.min_efficiency or None
    floored = floor and plan.rebuilt(model=dataclasses.replace(link_model, min_efficiency=floor))
    muon_bytes = sum(math.prod(info.shape) for info in infos) / tp * a.exchange_bytes
    # LayerWise and gather-everything in upstream's exact TP mode where ours is ``owner``
    ref = link_model
    if a.tp_mode == "owner":
        whole = lambda info: tp_ns_cost(info, NS_STEPS, "duplicated", tp)  # noqa: E731
        ref = dataclasses.replace(link_model, mode="duplicated", whole=whole)
    lw_ref = ref
    if a.tp_mode == "distributed":  # upstream's distributed mode splits every block
        split = lambda info: tp_ns_cost(info, NS_STEPS, "distributed", tp, gather=False)  # noqa: E731
        lw_ref = dataclasses.replace(link_model, whole=split)
    lw = layer_wise(params, dp, bucket, lw_ref, tp_link)
    lw_busiest = max(f / rate + t for f, t in zip(lw["flops"], lw["tp_seconds"]))
    ns = lambda p, **kw: ns_seconds(p, rate, link, tp_link, latency, **kw)  # noqa: E731
    distopt_numel = ddp_layout([math.prod(shape) for _, shape, _ in params], dp, bucket)[-1][1]
    # Padded buffers (LayerWise's, ours where shard-aligned), over DistOpt's one buffer, cost
    # their grad reduce-scatter and param all-gather too: per direction (dp-1)/dp of the extra
    # elements each (ring, duplex)
    extra = lw["numel"] - distopt_numel
    per_element = (dp - 1) / dp * (a.grad_bytes + a.param_bytes) / link
    moved = {p.matrix for ex in plan.exchanges for p in ex.pieces if p.holder != p.owner}
    row = {
        "layout": f"shard-aligned ({len(moved)} moved)" if aligned else "byte-level",
        "pad_comm": max(ours_numel - distopt_numel, 0) * per_element,
        "sync_points": plan_figures.sync_points(plan),
        "model": model,
        "params": total,
        "tp": tp,
        "dp": dp,
        "gpus": dp * tp,
        "buckets": len(plan.buckets),
        "step": 6 * total * a.tokens / (dp * tp * rate),
        "ns": ns(plan),
        "ns_no_tp": ns(plan, tp=False),
        "ns_flops": plan_figures.critical_path_flops(plan) / rate,
        "efficiency": plan_figures.efficiency(plan),
        "gangs": sum(len(ex.gangs) for ex in plan.exchanges),
        "comm": exchange_seconds(plan, forward, back, link),
        "flop_ns": ns(flop_only),
        "flop_ns_flops": plan_figures.critical_path_flops(flop_only) / rate,
        "flop_efficiency": plan_figures.efficiency(flop_only),
        "floor": floor,
        "floor_ns": floored and ns(floored),
        "floor_ns_flops": floored and plan_figures.critical_path_flops(floored) / rate,
        "floor_efficiency": floored and plan_figures.efficiency(floored),
        "floor_comm": floored and exchange_seconds(floored, forward, back, link),
        "unsplit_ns": plan_figures.critical_path_flops(unsplit) / rate,
        "unsplit_tp": ns(unsplit, tp_model=link_model)
        - plan_figures.critical_path_flops(unsplit) / rate,
        "unsplit_efficiency": plan_figures.efficiency(unsplit),
        "unsplit_comm": exchange_seconds(unsplit, forward, back, link),
        "base_ns": sum(ref.whole(i) for i in infos) / rate,
        "base_tp": sum(matrix_tp_bytes(ref, i) for i in infos) / tp_link,
        "base_comm": muon_bytes * (dp - 1) / dp / link,
        "lw_ns": max(lw["flops"]) / rate,
        "lw_tp": lw_busiest - max(lw["flops"]) / rate,
        "lw_efficiency": sum(lw["flops"]) / dp / max(lw["flops"]),
        "lw_comm": max(extra, 0) * per_element,
        "lw_extra": extra,
        "lw_buffer_ratio": lw["numel"] / distopt_numel,
        "lw_buffer_gb": lw["numel"] * (a.grad_bytes + a.param_bytes) / 1e9,
        "distopt_buffer_gb": distopt_numel * (a.grad_bytes + a.param_bytes) / 1e9,
        "lw_idle": sum(1 for f in lw["flops"] if f == 0),
    }
    if a.by_rank:
        row["by_rank"] = by_rank(plan, rank_ends(plan, rate, link, tp_link, latency), rate)
    if a.tp_mode != "owner" or tp == 1:  # at TP 1 every mode is one process's NS
        return row
    plans = {"": plan, "flop": flop_only, "floor": floored, "unsplit": unsplit}
    return with_owner(row, plans, rate, tp_link, tp)


def markdown(rows: list[dict]) -> str:
    head = (
        "| model | TP x DP (GPUs) | buckets | model step | our layout | gangs "
        "| ours: NS (+ gang sums) + TP + exchange (+ padding RS/AG) | efficiency | ours overhead "
        "| FLOPs-only plan: NS (+ gang + TP) (efficiency) | its overhead "
        f"{_floor_head(rows)}"
        "| one owner per matrix: NS + TP + exchange (efficiency) | its overhead "
        "| gather-everything: NS + TP + all-gather | baseline overhead |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + "---|---|"
        * _floored(rows)
    )
    lines = [head]
    for r in rows:
        pad = r["pad_comm"]  # the layout's, whatever the plan on it
        ours = r["ns"] + r["comm"] + pad
        unsplit = r["unsplit_ns"] + r["unsplit_tp"] + r["unsplit_comm"] + pad
        base = r["base_ns"] + r["base_tp"] + r["base_comm"]
        lines.append(
            f"| {r['model']} ({r['params'] / 1e9:.1f}B) | {r['tp']} x {r['dp']} ({r['gpus']}) "
            f"| {r['buckets']} | {_ms(r['step'])} | {r['layout']} | {r['gangs']} "
            f"| {_ours(r)} | {r['efficiency']:.3f} | {ours / r['step']:.1%} "
            f"| {_ms(r['flop_ns_flops'])} (+ {_ms(r['flop_ns'] - r['flop_ns_flops'])}) "
            f"({r['flop_efficiency']:.3f}) | {(r['flop_ns'] + r['comm'] + pad) / r['step']:.1%} "
            f"{_floor_cells(r)}"
            f"| {_ms(r['unsplit_ns'])} + {_ms(r['unsplit_tp'])} + {_ms(r['unsplit_comm'])} "
            f"({r['unsplit_efficiency']:.2f}) | {unsplit / r['step']:.1%} "
            f"| {_ms(r['base_ns'])} + {_ms(r['base_tp'])} + {_ms(r['base_comm'])} "
            f"| {base / r['step']:.1%} |"
        )
    return "\n".join(lines)


def layer_wise_markdown(rows: list[dict]) -> str:
    """Ours beside upstream's LayerWise Muon (its layout rule: whole matrices bin-packed per
    bucket, shards padded to the fullest), per row: Muon overhead per step and their ratio."""
    lines = [
        "| model | TP x DP (GPUs) | model step | our layout "
        "| ours: NS (+ gang) + TP + exchange (+ padding RS/AG) | ours overhead "
        "| LayerWise: NS (efficiency, idle ranks) + TP + padding RS/AG "
        "| DDP buffers/GPU: LayerWise vs DistOpt | LayerWise overhead | ours / LayerWise "
        "| LayerWise overhead, padding traffic hidden (NS + TP only) | ours / that |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours = (r["ns"] + r["comm"] + r["pad_comm"]) / r["step"]
        lw_ns = r["lw_ns"] + r["lw_tp"]  # the busiest rank's NS and TP time
        lw = (lw_ns + r["lw_comm"]) / r["step"]
        lines.append(
            f"| {r['model']} | {r['tp']} x {r['dp']} ({r['gpus']}) | {_ms(r['step'])} "
            f"| {r['layout']} | {_ours(r)} | {ours:.2%} "
            f"| {_ms(r['lw_ns'])} ({r['lw_efficiency']:.3f}, {r['lw_idle']}) + {_ms(r['lw_tp'])} "
            f"+ {_ms(r['lw_comm'])} "
            f"| {r['lw_buffer_gb']:.1f} vs {r['distopt_buffer_gb']:.1f} GB "
            f"| {lw:.2%} | {ours / lw:.2f} "
            f"| {lw_ns / r['step']:.2%} | {ours * r['step'] / lw_ns:.2f} |"
        )
    return "\n".join(lines)


def _ours(r: dict) -> str:
    """Our NS critical path (+ its gang collectives) + what the TP mode's collectives add to it
    + exchange (+ the layout's padding)."""
    pad = f" + {_ms(r['pad_comm'])}" if r["pad_comm"] else ""
    gang, tp = r["ns_no_tp"] - r["ns_flops"], r["ns"] - r["ns_no_tp"]
    return f"{_ms(r['ns_flops'])} (+ {_ms(gang)}) + {_ms(tp)} + {_ms(r['comm'])}{pad}"


def _floored(rows: list[dict]) -> bool:
    return bool(rows and rows[0]["floor"])


def _floor_head(rows: list[dict]) -> str:
    if not _floored(rows):
        return ""
    floor = rows[0]["floor"]
    head = f"| plan at efficiency >= {floor:g}: NS (+ gang + TP) + exchange (efficiency) "
    return head + "| its overhead "


def _floor_cells(r: dict) -> str:
    """The floored plan's columns (``--muon-plan-min-efficiency``), empty without a floor."""
    if not r["floor"]:
        return ""
    ns, flops, comm = r["floor_ns"], r["floor_ns_flops"], r["floor_comm"]
    return (
        f"| {_ms(flops)} (+ {_ms(ns - flops)}) + {_ms(comm)} ({r['floor_efficiency']:.3f}) "
        f"| {(ns + comm + r['pad_comm']) / r['step']:.1%} "
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def wire_bytes(a) -> tuple[int, int]:
    """Bytes per element the exchange moves out and back, by the optimizer's own rule
    (``exchange.exchange_dtypes``: out the narrower of the exchange and NS dtypes; back the
    NS dtype where it is narrower than the fp32 update, else the exchange dtype)."""
    names = {4: "fp32", 2: "bf16"}
    dtypes = {4: torch.float32, 2: torch.bfloat16}
    forward, back, _ = exchange_dtypes(names[a.exchange_bytes], dtypes[a.ns_bytes], torch.float32)
    return forward.itemsize, back.itemsize


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-tflops", type=float, default=990.0, help="H100 bf16 dense")
    parser.add_argument("--mfu", type=float, default=0.4, help="achieved fraction of peak")
    parser.add_argument("--link-gbps", type=float, default=400.0, help="per GPU, per direction")
    parser.add_argument(
        "--tp-link-gbps",
        type=float,
        default=NVLINK_GBPS,
        help="NVLink per GPU, per direction (the TP collectives' and intra-node gangs' link)",
    )
    parser.add_argument(
        "--gpus-per-node", type=int, default=8, help="NVLink domain; DP ranks fill nodes in order"
    )
    parser.add_argument(
        "--step-latency-us",
        type=float,
        default=0.0,
        help="latency of one ring step of a gang collective (0: bytes only)",
    )
    parser.add_argument("--tokens", type=int, default=4 * 1024 * 1024, help="global batch")
    parser.add_argument(
        "--exchange-bytes", type=int, choices=[4, 2], default=4, help="4 fp32 (default), 2 bf16"
    )
    parser.add_argument(
        "--ns-bytes", type=int, choices=[2, 4], default=2, help="NS matmul dtype: 2 bf16 (default)"
    )
    parser.add_argument(
        "--tp-mode",
        choices=["duplicated", "distributed", "blockwise", "owner"],
        default="duplicated",
        help="owner: LayerWise and gather-everything are then counted in duplicated",
    )
    parser.add_argument("--one-bucket", action="store_true", help="no --overlap-grad-reduce")
    parser.add_argument(
        "--min-efficiency",
        type=float,
        default=0.9,
        help="also plan with this --muon-plan-min-efficiency (0: no such column)",
    )
    parser.add_argument(
        "--grad-bytes",
        type=int,
        choices=[4, 2],
        default=4,
        help="DDP grad reduce-scatter dtype: 4 fp32 (Megatron-LM's default with bf16: "
        "fp32 main grads), 2 bf16",
    )
    parser.add_argument(
        "--param-bytes", type=int, choices=[4, 2], default=2, help="DDP param all-gather dtype"
    )
    parser.add_argument("--dps", type=int, nargs="+", default=list(DPS))
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument(
        "--by-rank",
        action="store_true",
        help="also, per row, the DP ranks grouped by what they orthogonalize: matmul time and "
        "when each reaches the return all-to-all (not with --tp-mode owner)",
    )
    a = parser.parse_args(argv)
    if a.by_rank and a.tp_mode == "owner":
        parser.error("--by-rank: the owner mode's NS is per TP rank (owner_ns), not per DP rank")
    return a


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    rows = [project(m, dp, a) for m in a.models for dp in a.dps]
    print(
        f"PROJECTION: {a.peak_tflops:g} TFLOP/s x {a.mfu:g} achieved (model and NS), "
        f"{a.link_gbps:g} Gb/s links, {a.tokens:,} tokens/step, exchange %d B/elt out, %d B back, "
        % wire_bytes(a)
        + f"{NS_STEPS} NS steps, TP mode "
        f"{a.tp_mode}, {'one bucket' if a.one_bucket else 'DDP buckets (overlap)'}, no overlap"
        + (f", {a.step_latency_us:g} us per gang ring step" if a.step_latency_us else "")
    )
    print(markdown(rows))
    print(
        "\nOurs vs upstream's LayerWise Muon (megatron-core 0.19.2's layout rule; padding traffic: "
        f"the padded buffers' extra grad reduce-scatter ({a.grad_bytes} B) and param all-gather "
        f"({a.param_bytes} B) over DistOpt's layout; buffers: params + grads per GPU)"
    )
    print(layer_wise_markdown(rows))
    for r in rows:
        if r.get("by_rank"):
            print(by_rank_markdown(r["model"], r["dp"], r["by_rank"]))
    return rows


if __name__ == "__main__":
    main()
