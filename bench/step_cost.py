"""Step cost: Muon vs AdamW, one process and DP=4 + DistributedOptimizer on gloo, side by side.

    .venv/bin/python bench/step_cost.py            # 4-layer GPT, hidden 256, 15 timed steps
    .venv/bin/python bench/step_cost.py --quick    # 2 layers, 6 timed steps (~1 min)

A real Megatron GPTModel (tests/tiny_gpt.py: local spec, GQA, SwiGLU) in DDP, built once per
variant on every rank; the variants' steps interleave (A, B, C, A, B, C, ...) so that load from
other processes hits all alike. Times: one training iteration (forward, backward, grad sync,
optimizer step) and the optimizer step alone, each the max over ranks, median over repeats.
DP=4 variants: AdamW+DistOpt, Muon+DistOpt (ours: one owner per matrix, DDP wrapped as
``get_model`` does for it: Muon matrices shard-aligned where whole matrices balance, so owners
are mostly their holders) with DDP's default (one bucket here) and with small buckets
(``--overlap-grad-reduce``, one or two matrices per bucket, as at scale), and Muon+DistOpt
with the gather-everything baseline (bench/gather_everything.py:
every rank gathers every Muon bucket and orthogonalizes every matrix). In bf16 (upstream's
LayerWise refuses fp16 and fails in fp32), default and small buckets: AdamW+DistOpt, ours and
upstream's Muon under its LayerWiseDistributedOptimizer (``UPSTREAM_MUON``; the seed recipe's
settings where upstream has them), with per-variant counts from the real layouts: bytes per step
of the whole iteration (DDP grad reduce-scatter and param all-gather of the padded buckets, our
exchange; checked against the recorded collectives of the same step), buffer padding, DDP
buffer, optimizer state and fp32 main-param bytes, NS FLOPs per rank. Counted figures (exact,
not timed): the plan's parallel efficiency (ideal / critical path; tests tie it to the FLOPs a
real step runs) for both bucket settings and, for comparison, the former bucket-by-bucket
schedule; Newton-Schulz FLOPs per rank, bytes moved per step by the Muon exchange (sent +
received per rank), optimizer state bytes per parameter (the inner optimizers' state tensors
after a step).
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from collectives import CollectiveRecorder, rank_bytes, tensor_bytes  # noqa: E402
from collectives import total as recorded_bytes  # noqa: E402
from gather_everything import (  # noqa: E402
    GatherEverythingOrthogonalizer,
    distopts,
    use_gather_everything,
)
from harness import run_distributed  # noqa: E402
from tiny_gpt import TinyGPT, build_model, build_optimizer, global_batches, train_step  # noqa: E402

from megatron.core.optimizer import OptimizerConfig  # noqa: E402
from megatron.core.optimizer.megatron_muon.planner import figures as plan_figures  # noqa: E402
from megatron.training.muon_recipe import SEED_RECIPE  # noqa: E402

MUON = dict(optimizer="muon", muon_fp32_matmul_prec="highest", **SEED_RECIPE)
# Upstream's Muon (emerging_optimizers' TensorParallelMuon) as Megatron-LM's CLI builds it with
# --optimizer muon --use-distributed-optimizer: the LayerWiseDistributedOptimizer for the
# matrices, chained with a DistributedOptimizer for AdamW's params. The seed recipe's settings
# where upstream has them: Nesterov, momentum 0.95, Keller Jordan's 'simple' coefficients, TP mode
# 'duplicated', 5 NS steps, fp32 Newton-Schulz ('highest'); the scale rule matched_adamw_rms=0.2
# is s = 0.2 sqrt(max(m, n)), which upstream spells scale_mode='spectral' (sqrt(max(m, n)),
# emerging_optimizers' get_muon_scale_factor) x extra_scale_factor=0.2 (config.resolve_scale:
# the same pair). LayerWise needs bf16: in fp32 its chain fails (ChainedOptimizer's config check).
_SHARED = {k: v for k, v in SEED_RECIPE.items() if k not in ("muon_impl", "muon_matched_adamw_rms")}
UPSTREAM_MUON = dict(
    optimizer="muon",
    muon_impl="emerging",
    use_layer_wise_distributed_optimizer=True,
    muon_fp32_matmul_prec="highest",
    muon_scale_mode="spectral",
    muon_extra_scale_factor=SEED_RECIPE.get("muon_matched_adamw_rms", 0.2),
    **_SHARED,
)
HAS_LAYER_WISE = "muon_impl" in {f.name for f in dataclasses.fields(OptimizerConfig)}
# elements; with --overlap-grad-reduce DDP cuts the model into buckets of one or two matrices,
# as its 40M-element buckets do on billion-parameter models. Both layouts are timed.
SMALL_BUCKET = 40_000
ADAM = dict(optimizer="adam")


@dataclasses.dataclass
class Variant:
    overrides: dict
    hook: Callable | None = None  # run on the optimizer once built
    bucket: int | None = None  # DDP bucket size (with --overlap-grad-reduce); None: one bucket
    dtype: str = "fp32"
    layer_wise: bool = False  # DDP wrapped for upstream's LayerWiseDistributedOptimizer
    muon_layout: bool = False  # DDP wrapped as get_model does for ours (shard-aligned if balanced)


SINGLE = {"adamw": Variant(ADAM), "muon": Variant(MUON)}
DP4 = {
    "adamw+distopt": Variant(ADAM),
    "muon+distopt": Variant(MUON, muon_layout=True),
    "adamw+distopt small buckets": Variant(ADAM, bucket=SMALL_BUCKET),
    "muon+distopt small buckets": Variant(MUON, bucket=SMALL_BUCKET, muon_layout=True),
    "muon+gather-everything": Variant(MUON, hook=use_gather_everything),
}
# The three-way comparison: AdamW+DistOpt, ours, upstream's LayerWise Muon, all bf16.
THREE = ("adamw", "ours", "layerwise")
BF16 = {
    ("adamw", False): Variant(ADAM, dtype="bf16"),
    ("ours", False): Variant(MUON, dtype="bf16", muon_layout=True),
    ("layerwise", False): Variant(UPSTREAM_MUON, dtype="bf16", layer_wise=True),
    ("adamw", True): Variant(ADAM, bucket=SMALL_BUCKET, dtype="bf16"),
    ("ours", True): Variant(MUON, bucket=SMALL_BUCKET, dtype="bf16", muon_layout=True),
    ("layerwise", True): Variant(UPSTREAM_MUON, bucket=SMALL_BUCKET, dtype="bf16", layer_wise=True),
}


def bf16_name(who: str, small: bool) -> str:
    return f"{who} bf16{' small buckets' if small else ''}"


if HAS_LAYER_WISE:
    DP4.update({bf16_name(who, small): v for (who, small), v in BF16.items()})


def spec_for(quick: bool) -> TinyGPT:
    return TinyGPT(
        num_layers=2 if quick else 4,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=704,
        vocab_size=256,
        seq_length=64,
        micro_batch_size=4,
        global_batch_size=16,
    )


def _timed_optimizer(optimizer, times: list):
    """Record each ``optimizer.step()``'s duration (barrier first: ranks start it together)."""
    step = optimizer.step

    def timed():
        torch.distributed.barrier()
        start = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - start)
        return out

    optimizer.step = timed
    return optimizer


def build_variant(spec: TinyGPT, v: Variant, distopt: bool):
    """(spec at the variant's dtype, DDP chunks, optimizer), as Megatron-LM builds them."""
    spec = dataclasses.replace(spec, dtype=v.dtype)
    overlap = v.bucket is not None
    model = build_model(
        spec,
        distopt=distopt,
        bucket_size=v.bucket,
        overlap_grad_reduce=overlap,
        layer_wise=v.layer_wise,
        muon_layout=v.muon_layout and distopt,
    )
    # LayerWise: Megatron-LM turns --use-distributed-optimizer off in the config (DDP keeps it)
    kwargs = {"use_distributed_optimizer": distopt and not v.layer_wise, **v.overrides}
    optimizer = build_optimizer(spec, model, **kwargs)
    if v.hook is not None:
        v.hook(optimizer)
    return spec, model, optimizer


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()


STAT = {"median": statistics.median, "min": min}


def time_variants(spec, variants: dict, distopt: bool, warmup: int, repeats: int, stat: str):
    """({variant: times}, {variant: (spec, model, optimizer)}, {variant: recorded calls}).

    Steps interleave (A, B, C, A, ...). times: "iter", "opt" (``stat`` over the repeats of the
    max over ranks) and "iters", "opts" (every repeat, for paired ratios). The collectives of
    the last warm-up step of each variant are recorded (``CollectiveRecorder``)."""
    built, opt_times, iter_times, recorded, losses = {}, {}, {}, {}, {}
    for name, v in variants.items():
        opt_times[name], iter_times[name] = [], []
        spec_v, model, optimizer = build_variant(spec, v, distopt)
        built[name] = (spec_v, model, _timed_optimizer(optimizer, opt_times[name]))
    batches = global_batches(spec, warmup + repeats)
    for step, batch in enumerate(batches):
        for name, (spec_v, model, optimizer) in built.items():
            record = step == max(warmup - 1, 0)
            recorder = CollectiveRecorder() if record else nullcontext([])
            torch.distributed.barrier()
            with recorder as calls:
                start = time.perf_counter()
                losses[name] = train_step(spec_v, model, optimizer, batch)["loss"]
                iter_times[name].append(time.perf_counter() - start)
            if record:
                recorded[name] = calls
    out = {}
    for name in built:
        its = [_max_over_ranks(t) for t in iter_times[name][warmup:]]
        ops = [_max_over_ranks(t) for t in opt_times[name][warmup:]]
        out[name] = {"iter": STAT[stat](its), "opt": STAT[stat](ops), "iters": its, "opts": ops}
        out[name]["loss"] = losses[name]
    return out, built, recorded


# ------------------------------------------------------------------------------ counted figures


def leaves(optimizer) -> list:
    """The Megatron optimizers that hold a torch optimizer, through nested chains (LayerWise is a
    ChainedOptimizer inside the outer chain)."""
    if hasattr(optimizer, "chained_optimizers"):
        return [leaf for o in optimizer.chained_optimizers for leaf in leaves(o)]
    return [optimizer]


def _is_muon(inner, param) -> bool:
    """Ours holds Muon and AdamW params in one optimizer (``is_muon``); upstream's Muon holds
    Muon params only."""
    if hasattr(inner, "is_muon"):
        return inner.is_muon(param)
    return "Muon" in type(inner).__name__


def state_bytes(optimizer) -> int:
    """Bytes of every tensor in the inner optimizers' state (created lazily: call after a step)."""
    return sum(
        tensor_bytes(state.values())
        for leaf in leaves(optimizer)
        for state in leaf.optimizer.state.values()
    )


def main_param_bytes(optimizer) -> int:
    """Bytes of the fp32 main copies of 16-bit params this rank holds (DistOpt: its shards;
    LayerWise's Float16Optimizer: its whole matrices). fp32 params have none (DistOpt's fp32
    shards are views of the model's params)."""
    total = 0
    for leaf in leaves(optimizer):
        for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(leaf, name, None) or []:
                total += tensor_bytes(group)
    return total


def muon_state_split(optimizer) -> tuple:
    """(Muon state bytes, Muon param elements, AdamW state bytes, AdamW param elements)."""
    out = [0, 0, 0, 0]
    for inner in (leaf.optimizer for leaf in leaves(optimizer)):
        for param, state in inner.state.items():
            k = 0 if _is_muon(inner, param) else 2
            out[k] += tensor_bytes(state.values())
            out[k + 1] += param.numel()
    return tuple(out)


def model_params(model) -> int:
    return sum(p.numel() for chunk in model for p in chunk.parameters())


def ddp_traffic(model) -> dict:
    """Bytes per step and rank of DDP's collectives, from the real buffers: each bucket's grad
    reduce-scatter (its padded size, grad dtype) and param all-gather (param dtype), as a ring
    moves them (``collectives.rank_bytes``); buffer padding (elements that are no param's:
    alignment, bucket ends, LayerWise's shard padding); the buffers' bytes (params + grads)."""
    out = dict(reduce_scatter=0, all_gather=0, padding=0, buffer_bytes=0, buckets=0)
    for chunk in model:
        for buffer in chunk.buffers + chunk.expert_parallel_buffers:
            world = buffer.data_parallel_world_size
            out["padding"] += buffer.numel - sum(p.numel() for p in buffer.params)
            out["buffer_bytes"] += tensor_bytes([buffer.param_data, buffer.grad_data])
            for bucket in buffer.buckets:
                out["buckets"] += 1
                grads, params = bucket.grad_data, bucket.param_data
                n = grads.numel()
                out["reduce_scatter"] += rank_bytes(
                    "reduce_scatter_tensor", n, grads.element_size(), world
                )
                if params is not None:  # DistOpt's (and LayerWise's) param all-gather
                    out["all_gather"] += rank_bytes(
                        "all_gather_into_tensor", n // world, params.element_size(), world
                    )
    return out


def ns_flops_per_rank(optimizer, model) -> list:
    """Newton-Schulz FLOPs of each DP rank: ours and the baseline from the plan; LayerWise from
    its real assignment (``dp_cp_params_list``: whole matrices per rank), each matrix counted
    with the same ``ns_cost`` (Q, K, V blocks apart, as both Muons split them)."""
    from megatron.core.optimizer.megatron_muon.factory import muon_param_infos
    from megatron.core.optimizer.megatron_muon.planner.plan import ns_cost

    for d in distopts(optimizer):
        if getattr(d, "muon_plan", None) is not None:
            return plan_figures.ns_flops_per_rank(d.muon_plan)
        if type(d).__name__ == "LayerWiseDistributedOptimizer":
            infos = muon_param_infos(OptimizerConfig(**MUON), model)
            steps = UPSTREAM_MUON.get("muon_num_ns_steps", 5)
            return [sum(ns_cost(infos[p], steps) for p in ps) for ps in d.dp_cp_params_list]
    return []


def exchange_bytes(optimizer) -> int:
    """Bytes of the last step's Muon exchange on this rank (ours or the baseline); LayerWise has
    none (its matrices are whole on their owners; its all-gather is DDP's, in ``ddp_traffic``)."""
    for d in distopts(optimizer):
        ortho = getattr(getattr(d, "optimizer", None), "orthogonalizer", None)
        if getattr(d, "muon_plan", None) is not None and ortho is not None:
            return ortho.bytes_moved
    return 0


def variant_counts(model, optimizer, calls: list) -> dict:
    """Counted bytes and memory of one variant on this rank (after >= 1 step)."""
    traffic = ddp_traffic(model)
    traffic["exchange"] = exchange_bytes(optimizer)
    traffic["total"] = traffic["reduce_scatter"] + traffic["all_gather"] + traffic["exchange"]
    traffic["recorded"] = recorded_bytes(calls)
    by_op = {}
    for c in calls:
        by_op[c.op] = by_op.get(c.op, 0) + c.bytes
    traffic["recorded_by_op"] = by_op
    traffic["state"] = state_bytes(optimizer)
    traffic["main_params"] = main_param_bytes(optimizer)
    traffic["ns_flops"] = ns_flops_per_rank(optimizer, model)
    return traffic


def exchange_figures(built: dict) -> dict:
    """Counted NS FLOPs and bytes of ours vs the baseline, on this rank (after >= 1 step)."""
    (ours,) = [d for d in distopts(built["muon+distopt"][2]) if hasattr(d, "muon_plan")]
    (base,) = [d for d in distopts(built["muon+gather-everything"][2]) if hasattr(d, "muon_plan")]
    plan = ours.muon_plan
    (small,) = [d for d in distopts(built["muon+distopt small buckets"][2])]
    return {
        "efficiency": {
            "one bucket": plan_figures.efficiency(plan),
            "small buckets": plan_figures.efficiency(small.muon_plan),
            "small buckets, bucket by bucket": plan_figures.efficiency(
                plan_figures.with_window(small.muon_plan, 1)
            ),
        },
        "sync_points": plan_figures.sync_points(small.muon_plan),
        "ns_flops_per_rank": plan_figures.ns_flops_per_rank(plan),
        "ns_flops_total": sum(m.cost for m in plan.matrices),
        "matrices": len(plan.matrices),
        "bytes_ours": ours.optimizer.orthogonalizer.bytes_moved,
        "bytes_ours_planned": plan_figures.bytes_per_step(plan, 4, 4),
        "bytes_baseline": base.optimizer.orthogonalizer.bytes_moved,
        "muon_bytes": sum((m.end - m.start) * 4 for m in plan.matrices),
    }


def small_bucket_bytes(spec: TinyGPT) -> dict:
    """Counted exchange bytes per rank when DDP cuts the model into many small buckets (as with
    overlap_grad_reduce at scale): every matrix is then spread over all DP ranks. No step run."""
    model = build_model(spec, distopt=True, bucket_size=SMALL_BUCKET, overlap_grad_reduce=True)
    optimizer = build_optimizer(spec, model, use_distributed_optimizer=True, **MUON)
    (distopt,) = [d for d in distopts(optimizer) if hasattr(d, "muon_plan")]
    base = GatherEverythingOrthogonalizer(distopt.muon_plan, None)
    return {
        "buckets": len(distopt.muon_plan.buckets),
        "ours": plan_figures.bytes_per_step(distopt.muon_plan, 4, 4),
        "baseline": base.bytes_per_step(4),
    }


def run_rank(spec, variants: dict, distopt: bool, warmup: int, repeats: int, stat: str) -> dict:
    times, built, recorded = time_variants(spec, variants, distopt, warmup, repeats, stat)
    result = {"times": times, "params": model_params(built[next(iter(built))][1])}
    result["state"] = {name: state_bytes(opt) for name, (_, _, opt) in built.items()}
    result["split"] = {name: muon_state_split(opt) for name, (_, _, opt) in built.items()}
    if distopt:
        result.update(exchange_figures(built))
        result["small"] = small_bucket_bytes(spec)
        result["counts"] = {
            name: variant_counts(model, opt, recorded[name])
            for name, (_, model, opt) in built.items()
        }
    return result


def measure(quick: bool, repeats: int | None = None, stat: str = "median") -> dict:
    """Both runs (1 process, then 4 ranks); returns every figure the report prints."""
    spec = spec_for(quick)
    repeats = repeats or (6 if quick else 15)
    args = (spec, SINGLE, False, 2, repeats, stat)
    single = run_distributed(run_rank, 1, args=args, timeout=900)
    args = (spec, DP4, True, 2, repeats, stat)
    dp4 = run_distributed(run_rank, 4, args=args, timeout=900)
    return {"spec": spec, "repeats": repeats, "stat": stat, "single": single[0], "dp4": dp4}


# ------------------------------------------------------------------------------------ report


def ratios(fig: dict) -> list[tuple]:
    """(label, value) rows of the one-table summary."""
    s, d = fig["single"]["times"], fig["dp4"][0]["times"]
    mu, ad, ge = d["muon+distopt"], d["adamw+distopt"], d["muon+gather-everything"]
    sm, sa = d["muon+distopt small buckets"], d["adamw+distopt small buckets"]
    return [
        ("1 proc: Muon / AdamW, optimizer step time", s["muon"]["opt"] / s["adamw"]["opt"]),
        ("1 proc: Muon / AdamW, iteration time", s["muon"]["iter"] / s["adamw"]["iter"]),
        ("DP=4: Muon+DistOpt / AdamW+DistOpt, optimizer step", mu["opt"] / ad["opt"]),
        ("DP=4: Muon+DistOpt / AdamW+DistOpt, iteration", mu["iter"] / ad["iter"]),
        ("DP=4: Muon+DistOpt / gather-everything, optimizer step", mu["opt"] / ge["opt"]),
        ("DP=4: Muon+DistOpt / gather-everything, iteration", mu["iter"] / ge["iter"]),
        (
            "DP=4, small buckets: Muon+DistOpt / AdamW+DistOpt, optimizer step",
            sm["opt"] / sa["opt"],
        ),
        ("DP=4, small buckets: Muon+DistOpt / AdamW+DistOpt, iteration", sm["iter"] / sa["iter"]),
    ] + three_way_ratios(fig)


def paired(a: dict, b: dict, key: str) -> tuple:
    """(median, min, max) over the repeats of a's time / b's at the same step: the variants'
    steps interleave, so each pair ran under the same load. ``key``: "iter" or "opt"."""
    r = [x / y for x, y in zip(a[key + "s"], b[key + "s"])]
    return statistics.median(r), min(r), max(r)


LABELS = {"adamw": "AdamW+DistOpt", "ours": "ours (Muon+DistOpt)", "layerwise": "LayerWise Muon"}
PAIRS = (("ours", "adamw"), ("layerwise", "adamw"), ("ours", "layerwise"))


def three_way_ratios(fig: dict) -> list[tuple]:
    """Paired medians of the bf16 three-way comparison (empty on a base without LayerWise)."""
    d = fig["dp4"][0]["times"]
    rows = []
    for small in (False, True):
        if bf16_name("layerwise", small) not in d:
            continue
        where = "DP=4 bf16" + (", small buckets" if small else "")
        for key, what in (("opt", "optimizer step"), ("iter", "iteration")):
            for a, b in PAIRS:
                ratio = paired(d[bf16_name(a, small)], d[bf16_name(b, small)], key)[0]
                rows.append((f"{where}: {LABELS[a]} / {LABELS[b]}, {what}", ratio))
    return rows


def three_way_counted(fig: dict) -> list[tuple]:
    rows = []
    ranks = fig["dp4"]
    for small in (False, True):
        name = {who: bf16_name(who, small) for who in THREE}
        if name["layerwise"] not in ranks[0]["counts"]:
            continue
        c = {who: [r["counts"][name[who]] for r in ranks] for who in THREE}
        where = "DP=4 bf16" + (", small buckets" if small else "")
        top = {who: max(x["total"] for x in c[who]) for who in ("ours", "layerwise")}
        flops = {who: max(c[who][0]["ns_flops"]) for who in ("ours", "layerwise")}
        rows += [
            (
                f"{where}: bytes/rank/step, whole iteration, ours / LayerWise (max over ranks)",
                top["ours"] / top["layerwise"],
            ),
            (
                f"{where}: NS FLOPs per rank (max), ours / LayerWise",
                flops["ours"] / flops["layerwise"],
            ),
        ]
    return rows


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f} MB"


def _spread(med: float, lo: float, hi: float, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(med)} [{fmt.format(lo)}-{fmt.format(hi)}]"


def three_way_markdown(fig: dict) -> str:
    """Markdown tables: AdamW+DistOpt, ours, LayerWise at DP=4 in bf16, per bucket setting."""
    names = fig["dp4"][0]["times"]
    tables = [
        _three_way_table(fig["dp4"], s) for s in (False, True) if bf16_name("layerwise", s) in names
    ]
    return "\n".join(tables)


def _three_way_table(ranks: list, small: bool) -> str:
    name = {who: bf16_name(who, small) for who in THREE}
    t = {who: ranks[0]["times"][name[who]] for who in THREE}
    c = {who: [r["counts"][name[who]] for r in ranks] for who in THREE}

    def row(label, cell):
        return f"| {label} | " + " | ".join(cell(who) for who in THREE) + " |"

    def ms(who, key):
        xs = t[who][key + "s"]
        return _spread(1e3 * statistics.median(xs), 1e3 * min(xs), 1e3 * max(xs), "{:.0f}")

    def ratio(who, key):
        return "1" if who == "adamw" else _spread(*paired(t[who], t["adamw"], key))

    def top(key):
        return lambda who: _mb(max(x[key] for x in c[who]))

    def flops(who):
        f = c[who][0]["ns_flops"]
        return " / ".join(f"{x / 1e9:.2f}" for x in f) if f else "0"

    def efficiency(who):
        f = c[who][0]["ns_flops"]
        return f"{sum(f) / len(f) / max(f):.3f}" if f and max(f) else ""

    buckets = "small buckets (--overlap-grad-reduce, 40k elements)" if small else "DDP default"
    return "\n".join(
        [
            f"DP=4, bf16, {buckets}; times: median [min-max] of {len(t['adamw']['iters'])} "
            "interleaved repeats, max over ranks; ratios: median [min-max] of the per-repeat "
            "ratios; bytes: max over ranks, per step",
            "",
            "| figure | " + " | ".join(LABELS[w] for w in THREE) + " |",
            "|---|---|---|---|",
            row("optimizer step, ms", lambda w: ms(w, "opt")),
            row("iteration, ms", lambda w: ms(w, "iter")),
            row("optimizer step / AdamW's", lambda w: ratio(w, "opt")),
            row("iteration / AdamW's", lambda w: ratio(w, "iter")),
            row("DDP grad reduce-scatter, bytes/rank/step", top("reduce_scatter")),
            row("DDP param all-gather, bytes/rank/step", top("all_gather")),
            row("Muon exchange, bytes/rank/step", top("exchange")),
            row("**whole iteration, bytes/rank/step**", top("total")),
            row("recorded: every collective of a step (+ scalars)", top("recorded")),
            row("DDP buckets", lambda w: str(c[w][0]["buckets"])),
            row("buffer padding, elements", lambda w: f"{c[w][0]['padding']:,}"),
            row("DDP buffers (params + grads), bytes/rank", top("buffer_bytes")),
            row("optimizer state, bytes/rank (max)", top("state")),
            row("fp32 main params, bytes/rank (max)", top("main_params")),
            row("NS GFLOP per rank", flops),
            row("NS counted efficiency (mean / max)", efficiency),
            row("loss after the last step", lambda w: f"{t[w]['loss']:.4f}"),
            "",
            "ours / LayerWise: optimizer step "
            + _spread(*paired(t["ours"], t["layerwise"], "opt"))
            + ", iteration "
            + _spread(*paired(t["ours"], t["layerwise"], "iter")),
            "",
        ]
    )


def counted(fig: dict) -> list[tuple]:
    ranks = fig["dp4"]
    flops = ranks[0]["ns_flops_per_rank"]
    mean = sum(flops) / len(flops)
    ours = [r["bytes_ours"] for r in ranks]
    base = [r["bytes_baseline"] for r in ranks]
    single = fig["single"]
    per_param = {k: v / single["params"] for k, v in single["state"].items()}
    mb, mn, _, _ = single["split"]["muon"]
    efficiency = [
        (f"DP=4: counted parallel efficiency (ideal / critical path), {k}", v)
        for k, v in ranks[0]["efficiency"].items()
    ]
    return (
        efficiency
        + [
            ("DP=4: NS FLOPs per rank max / mean (ours)", max(flops) / mean),
            (
                "DP=4: NS FLOPs per rank, ours max / baseline",
                max(flops) / ranks[0]["ns_flops_total"],
            ),
            ("DP=4: exchange bytes/step/rank, ours max / baseline max", max(ours) / max(base)),
            (
                "DP=4: exchange bytes/step/rank ours max / Muon momentum bytes",
                max(ours) / ranks[0]["muon_bytes"],
            ),
            (
                "DP=4, small buckets: exchange bytes/rank, ours max / baseline max",
                max(r["small"]["ours"] for r in ranks) / max(r["small"]["baseline"] for r in ranks),
            ),
            (
                "DP=4, small buckets: exchange bytes/rank, ours max / Muon momentum",
                max(r["small"]["ours"] for r in ranks) / ranks[0]["muon_bytes"],
            ),
            (
                "optimizer state bytes/param, Muon / AdamW (whole model)",
                per_param["muon"] / per_param["adamw"],
            ),
            ("optimizer state bytes per Muon-param element (fp32)", mb / mn),
        ]
        + three_way_counted(fig)
    )


def details(fig: dict) -> str:
    spec, ranks = fig["spec"], fig["dp4"]
    flops = ranks[0]["ns_flops_per_rank"]
    lines = [
        f"GPT: {spec.num_layers} layers, hidden {spec.hidden_size}, ffn {spec.ffn_hidden_size}, "
        f"GQA {spec.num_attention_heads}/{spec.num_query_groups}, seq {spec.seq_length}, "
        f"global batch {spec.global_batch_size}; {fig['single']['params']:,} params, "
        f"{ranks[0]['matrices']} Muon matrices; {fig['stat']} of {fig['repeats']} steps, "
        "max over ranks",
        f"{'variant':>24} {'iteration ms':>13} {'optimizer step ms':>18}",
    ]
    for part in ("single", "dp4"):
        times = fig[part]["times"] if part == "single" else ranks[0]["times"]
        for name, t in times.items():
            label = f"{name} ({'1 proc' if part == 'single' else 'DP=4'})"
            lines.append(f"{label:>30} {t['iter'] * 1e3:>10.1f} {t['opt'] * 1e3:>15.1f}")
    lines.append(
        f"NS GFLOP per rank, ours: {[round(f / 1e9, 3) for f in flops]}; "
        f"baseline: {ranks[0]['ns_flops_total'] / 1e9:.3f} on every rank"
    )
    lines.append(
        f"Muon exchange bytes/step per rank, ours: {[r['bytes_ours'] for r in ranks]} "
        f"(planned {[r['bytes_ours_planned'] for r in ranks]}); baseline: "
        f"{[r['bytes_baseline'] for r in ranks]}; Muon momentum (fp32, whole model): "
        f"{ranks[0]['muon_bytes']}"
    )
    small = [r["small"] for r in ranks]
    lines.append(
        f"with {small[0]['buckets']} buckets of {SMALL_BUCKET} elements (counted, not timed): "
        f"ours {[b['ours'] for b in small]}, baseline {[b['baseline'] for b in small]}; "
        f"{ranks[0]['sync_points']} Muon sync point(s) per step"
    )
    for name, v in fig["single"]["state"].items():
        lines.append(f"optimizer state, {name} (1 proc): {v / fig['single']['params']:.2f} B/param")
    for name, v in ranks[0]["state"].items():
        total = sum(r["state"][name] for r in ranks)
        lines.append(
            f"optimizer state, {name} (DP=4): {v / ranks[0]['params']:.2f} B/param on "
            f"rank 0, {total / ranks[0]['params']:.2f} B/param summed over ranks"
        )
    return "\n".join(lines)


def table(rows: list[tuple]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value:8.3f}" for label, value in rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 6 timed steps")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per variant")
    # min estimates the uncontended time: use it when other jobs share the cores
    parser.add_argument("--stat", choices=list(STAT), default="median")
    args = parser.parse_args(argv)
    fig = measure(args.quick, args.repeats, args.stat)
    print(details(fig))
    print()
    print(three_way_markdown(fig))
    print(f"\nratios (timed: CPU gloo, {args.stat}; counted: exact)")
    print(table(ratios(fig) + counted(fig)))
    return fig


if __name__ == "__main__":
    main()
