"""PROJECTION (not a measurement): Muon's overhead per step under Megatron-FSDP (ZeRO-3) at scale,
beside its overhead under the DistributedOptimizer, for 8B and 70B at DP 8-1024.

    .venv/bin/python bench/projection_fsdp.py            # markdown table, projection.py's defaults
    .venv/bin/python bench/projection_fsdp.py --dps 8 64

It models the schedule the FSDP code executes (``--use-megatron-fsdp``,
``--data-parallel-sharding-strategy optim_grads_params``), per DP rank and step:

* layout: Megatron-FSDP's parameter groups and flat buffers, from upstream's own code
  (``_get_parameter_groups``, ``build_data_parallel_buffer_index``) run on meta tensors of the
  TP-local shapes: one group per transformer layer (its FSDP unit), the other params in groups of
  ``bucket_size`` (Megatron-LM's ``max(40M, 1M dp)``), each buffer padded to
  ``dp * chunk_size_factor`` and cut in ``dp`` equal shards;
* the framework's collectives (``schedule``), per micro-batch (``--seq-length``,
  ``--micro-batch-size``): each layer group's param all-gather before its forward and again
  before its backward (resharded after each; the other groups' once a step), each group's grad
  reduce-scatter, at ``--param-bytes`` and ``--grad-bytes`` per element; both optimizers pay
  them alike;
* ours: the plan our FSDP code builds (``fsdp.build_plans`` on those layouts), its all-to-alls to
  the owners and back (``figures.bytes_per_step``; time as projection.py's ``exchange_seconds``)
  and its Newton-Schulz critical path with the TP mode's collectives (projection.py's
  ``ns_seconds``);
* AdamW under FSDP: the same framework collectives, no exchange, no Newton-Schulz.

Muon's overhead = (NS + TP + exchange) / model step, the DistOpt section's definition (model step:
``6 N tokens / (gpus * peak * mfu)``; the framework's collectives overlapped with compute under
both optimizers, Muon's work not overlapped: an upper bound). The DistOpt column is projection.py's
"ours overhead" for the same row (our layout, padding RS/AG included).
tests/distributed/test_fsdp_projection.py ties ``counts`` to a real Megatron-FSDP step.
"""

import argparse
import math
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import projection  # noqa: E402
from collectives import rank_bytes  # noqa: E402

from megatron.core.optimizer.megatron_muon import fsdp  # noqa: E402
from megatron.core.optimizer.megatron_muon.planner import figures as plan_figures  # noqa: E402
from megatron.core.optimizer.megatron_muon.planner.cost_model import PlanLinks  # noqa: E402

MODELS = ("8B", "70B")
STRATEGY = "optim_grads_params"


class _Unit(torch.nn.Module):
    """Stands for TransformerLayer: Megatron-FSDP's FSDP unit under ``optim_grads_params``."""


def _meta_module(params: list[tuple]) -> torch.nn.Module:
    """A module tree of meta params with ``params``' names and TP-local shapes, in their order;
    ``decoder.layers.<i>`` are FSDP units."""
    root = torch.nn.Module()
    for name, shape, _ in params:
        *path, leaf = name.split(".")
        node = root
        for depth, part in enumerate(path):
            if not hasattr(node, part):
                unit = path[max(depth - 2, 0) : depth] == ["decoder", "layers"]
                node.add_module(part, _Unit() if unit else torch.nn.Module())
            node = getattr(node, part)
        node.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, device="meta")))
    return root


def fsdp_layout(params: list[tuple], dp: int, bucket_size) -> list[dict]:
    """Megatron-FSDP's parameter groups for ``params`` [(name, TP-local shape, info or None)],
    by upstream's code (megatron_fsdp/param_and_grad_buffer.py).

    Args:
        params: in ``named_parameters`` order.
        dp: data-parallel size.
        bucket_size: the groups' suggested size for params outside FSDP units (None: one).

    Returns:
        Per group: ``size`` (padded buffer elements), ``unit`` (an FSDP unit's) and ``items``
        {param index: (start, end)}.
    """
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buf

    root = _meta_module(params)
    index = {id(p): i for i, (_, p) in enumerate(root.named_parameters())}
    policy = buf.BucketingPolicy(bucket_size, [_Unit], STRATEGY)
    groups, _, _ = buf._get_parameter_groups(root, policy, {})
    config = SimpleNamespace(data_parallel_sharding_strategy=STRATEGY)
    out = []
    for group in groups:
        shapes = [p.shape for p in group.params]
        items, bucket, _ = buf.build_data_parallel_buffer_index(
            shapes, 0, dp, True, config, chunk_size_factor=group.chunk_size_factor
        )
        members = {
            index[id(p)]: (items[k].global_data_index, items[k].global_data_index + items[k].size)
            for k, p in enumerate(group.params)
        }
        out.append(dict(size=bucket.size, unit=group.fsdp_unit_id is not None, items=members))
    return out


def schedule(
    groups: list[dict],
    dp: int,
    param_bytes: int,
    grad_bytes: int,
    micro_batches: int,
    backward_gathers: bool = True,
) -> list[tuple]:
    """The framework's collectives of one step on a rank, as Megatron-FSDP ``optim_grads_params``
    issues them (recorded on a real step: tests/distributed/test_fsdp_projection.py):
    [(op, elements, itemsize)]. Per FSDP-unit group and micro-batch: its shard all-gathered
    before the forward (the first micro-batch's is the prefetch after the previous optimizer
    step) and again before the backward (resharded after each); per other group (embedding,
    output layer, final norm: kept whole between forward and backward) one all-gather, after
    the optimizer step; per group and micro-batch, a reduce-scatter of its grad buffer."""
    out = []
    for g in groups:
        gathers = micro_batches * (1 + backward_gathers) if g["unit"] else 1
        out += [("all_gather_into_tensor", g["size"] // dp, param_bytes)] * gathers
        out += [("reduce_scatter_tensor", g["size"], grad_bytes)] * micro_batches
    return out


class _Group:
    """A DP group as ``fsdp.build_plans`` reads it (rank 0's view; figures cover every rank)."""

    def __init__(self, dp: int):
        self._dp = dp

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self._dp


def fsdp_plan(params: list[tuple], groups: list[dict], dp: int, model):
    """Our plan under Megatron-FSDP: ``fsdp.build_plans`` on the groups' matrices, in the
    optimizer's order (group by group, by position), as ``megatron_fsdp_matrix`` reads them."""
    group = _Group(dp)
    held = []
    for b, g in enumerate(groups):
        shard = g["size"] // dp
        for i, (start, end) in sorted(g["items"].items(), key=lambda kv: kv[1]):
            name, shape, info = params[i]
            if info is not None:
                held.append(fsdp.HeldMatrix(None, name, group, b, start, end, shard, shape, info))
    ((plan, _),) = fsdp.build_plans(held, lambda _: model)
    return plan


def counts(
    params, dp: int, model, bucket_size, micro_batches: int, itemsizes=(4, 4), sizes=(4, 4), **kw
) -> list:
    """Per DP rank: bytes of the framework's collectives (``fsdp_bytes``; params and grads in
    ``sizes`` bytes per element), of our exchange (``exchange_bytes``, forward and return
    ``itemsizes``) and NS FLOPs (``ns_flops``), ring model as bench/collectives.py counts them.
    ``kw`` goes to ``schedule`` (tests)."""
    param_bytes, grad_bytes = sizes
    groups = fsdp_layout(params, dp, bucket_size)
    calls = schedule(groups, dp, param_bytes, grad_bytes, micro_batches, **kw)
    framework = sum(rank_bytes(op, n, size, dp) for op, n, size in calls)
    plan = fsdp_plan(params, groups, dp, model)
    flops = plan_figures.ns_flops_per_rank(plan)
    return [
        dict(
            fsdp_bytes=framework,
            exchange_bytes=plan_figures.bytes_per_step(plan, *itemsizes, rank=r),
            ns_flops=flops[r],
        )
        for r in range(dp)
    ]


def project(model: str, dp: int, a) -> dict:
    """One row: ours and AdamW under Megatron-FSDP, and ours under DistOpt, for ``model`` at
    ``dp`` with projection.py's assumptions ``a``."""
    cfg = projection.MODELS[model]
    tp = cfg[-1]
    params = projection.model_params(*cfg)
    total = sum(math.prod(shape) * (tp if len(shape) == 2 else 1) for _, shape, _ in params)
    rate, link = a.peak_tflops * 1e12 * a.mfu, a.link_gbps / 8 * 1e9
    tp_link, latency = a.tp_link_gbps / 8 * 1e9, a.step_latency_us * 1e-6
    forward, back = projection.wire_bytes(a)
    links = PlanLinks(rate / 1e12, a.link_gbps, a.tp_link_gbps)
    link_model = projection.cost_model(
        tp,
        a.tp_mode,
        **links.link_costs(),
        ns_itemsize=a.ns_bytes,
        exchange_itemsizes=forward + back,
        nodes=tuple(r // max(1, a.gpus_per_node // tp) for r in range(dp)),
        step_latency_flops=rate * latency,
    )
    bucket = projection.ddp_bucket_size(dp, not a.one_bucket)
    ns = lambda p: projection.ns_seconds(p, rate, link, tp_link, latency)  # noqa: E731
    # under Megatron-FSDP
    groups = fsdp_layout(params, dp, bucket)
    plan = fsdp_plan(params, groups, dp, link_model)
    micro = micro_batches(a, dp)
    calls = schedule(groups, dp, a.param_bytes, a.grad_bytes, micro)
    fsdp_bytes = sum(rank_bytes(op, n, size, dp) for op, n, size in calls)
    exchange = [plan_figures.bytes_per_step(plan, forward, back, rank=r) for r in range(dp)]
    # under DistOpt: projection.py's "ours" (its layout, plan, padding RS/AG)
    aligned, buckets, ours_numel = projection.ours_layout(params, dp, bucket)
    d_plan = projection.build_plan(params, buckets, dp, link_model)
    distopt_numel = projection.ddp_layout([math.prod(s) for _, s, _ in params], dp, bucket)[-1][1]
    per_element = (dp - 1) / dp * (a.grad_bytes + a.param_bytes) / link
    pad = max(ours_numel - distopt_numel, 0) * per_element
    return {
        **memory_gb(params, dp, a.param_bytes),
        "model": model,
        "params": total,
        "tp": tp,
        "dp": dp,
        "gpus": dp * tp,
        "step": 6 * total * a.tokens / (dp * tp * rate),
        "groups": len(groups),
        "micro": micro,
        "fsdp_gb": fsdp_bytes / 1e9,
        "fsdp_s": fsdp_bytes / 2 / link,  # sent + received over a duplex link
        "exchange_gb": max(exchange) / 1e9,
        "ns_gflop": max(plan_figures.ns_flops_per_rank(plan)) / 1e9,
        "ns": ns(plan),
        "efficiency": plan_figures.efficiency(plan),
        "comm": projection.exchange_seconds(plan, forward, back, link),
        "d_layout": "shard-aligned" if aligned else "byte-level",
        "d_ns": ns(d_plan),
        "d_comm": projection.exchange_seconds(d_plan, forward, back, link) + pad,
        "d_gflop": max(plan_figures.ns_flops_per_rank(d_plan)) / 1e9,
    }


def memory_gb(params: list[tuple], dp: int, param_bytes: int) -> dict:
    """GB per GPU of model params (``param_bytes``), fp32 grads, fp32 main params and optimizer
    state (Muon: a fp32 momentum per matrix element; Adam: two fp32 moments), unpadded:
    ZeRO-3 shards all four over DP, DistOpt the last two only."""
    n = sum(math.prod(shape) for _, shape, _ in params)  # per TP rank
    m = sum(math.prod(shape) for _, shape, info in params if info is not None)
    muon_state, adam_state = 4 * m + 8 * (n - m), 8 * n
    whole = (param_bytes + 4) * n  # model params and grads
    return {
        "mem_muon_fsdp": (whole + 4 * n + muon_state) / dp / 1e9,
        "mem_adamw_fsdp": (whole + 4 * n + adam_state) / dp / 1e9,
        "mem_muon_distopt": (whole + (4 * n + muon_state) / dp) / 1e9,
    }


def micro_batches(a, dp: int) -> int:
    """Micro-batches per DP rank and step: tokens / (sequence x micro-batch size x dp), >= 1."""
    return max(1, a.tokens // (a.seq_length * a.micro_batch_size * dp))


def parse_args(argv=None):
    """projection.py's options plus the micro-batching Megatron-FSDP's collectives follow."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--seq-length", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch")
    ours, rest = parser.parse_known_args(argv)
    a = projection.parse_args(rest)
    a.seq_length, a.micro_batch_size = ours.seq_length, ours.micro_batch_size
    return a


def markdown(rows: list[dict]) -> str:
    """The FSDP section: per row, the framework's traffic (both optimizers), ours' exchange and
    NS, Muon's overhead under FSDP and under DistOpt, and whether FSDP's is no larger."""
    lines = [
        "| model | TP x DP (GPUs) | model step | FSDP groups, micro-batches "
        "| AdamW under FSDP: AG + RS per GPU (at the link) "
        "| ours under FSDP: + exchange per GPU (busiest) | traffic ours / AdamW "
        "| NS GFLOP per GPU (busiest), efficiency "
        "| ours under FSDP: NS (+ gang + TP) + exchange | Muon overhead, FSDP "
        "| ours under DistOpt: NS (+ gang + TP) + exchange (+ padding) | Muon overhead, DistOpt "
        "| FSDP - DistOpt | goal: FSDP <= DistOpt "
        "| params + grads + main params + state per GPU: ours FSDP / AdamW FSDP / ours DistOpt |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fsdp_s, distopt_s = r["ns"] + r["comm"], r["d_ns"] + r["d_comm"]
        lines.append(
            f"| {r['model']} ({r['params'] / 1e9:.1f}B) | {r['tp']} x {r['dp']} ({r['gpus']}) "
            f"| {_ms(r['step'])} | {r['groups']}, {r['micro']} "
            f"| {r['fsdp_gb']:.1f} GB ({_ms(r['fsdp_s'])}) | + {r['exchange_gb']:.2f} GB "
            f"| {1 + r['exchange_gb'] / r['fsdp_gb']:.4f} "
            f"| {r['ns_gflop']:.0f}, {r['efficiency']:.3f} "
            f"| {_ms(r['ns'])} + {_ms(r['comm'])} | {fsdp_s / r['step']:.3%} "
            f"| {_ms(r['d_ns'])} + {_ms(r['d_comm'])} ({r['d_layout']}) "
            f"| {distopt_s / r['step']:.3%} | {_ms(fsdp_s - distopt_s)} "
            f"| {'met' if fsdp_s <= distopt_s else 'NOT met'} "
            f"| {r['mem_muon_fsdp']:.1f} / {r['mem_adamw_fsdp']:.1f} "
            f"/ {r['mem_muon_distopt']:.1f} GB |"
        )
    return "\n".join(lines)


_ms = projection._ms


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    rows = [project(m, dp, a) for m in MODELS for dp in a.dps]
    forward, back = projection.wire_bytes(a)
    print(
        f"PROJECTION, Megatron-FSDP {STRATEGY}: {a.peak_tflops:g} TFLOP/s x {a.mfu:g}, "
        f"{a.link_gbps:g} Gb/s links, {a.tokens:,} tokens/step in sequences of {a.seq_length} "
        f"(micro-batch {a.micro_batch_size}), params all-gathered in "
        f"{a.param_bytes} B, grads reduce-scattered in {a.grad_bytes} B, exchange {forward} B/elt "
        f"out, {back} B back, {projection.NS_STEPS} NS steps, TP mode {a.tp_mode}, no overlap of "
        "Muon"
    )
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
