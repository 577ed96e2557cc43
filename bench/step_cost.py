"""Step cost: Muon vs AdamW, one process and DP=4 + DistributedOptimizer on gloo, side by side.

    .venv/bin/python bench/step_cost.py            # 4-layer GPT, hidden 256, 15 timed steps
    .venv/bin/python bench/step_cost.py --quick    # 2 layers, 6 timed steps (~1 min)

A real Megatron GPTModel (tests/tiny_gpt.py: local spec, GQA, SwiGLU) in DDP, built once per
variant on every rank; the variants' steps interleave (A, B, C, A, B, C, ...) so that load from
other processes hits all alike. Times: one training iteration (forward, backward, grad sync,
optimizer step) and the optimizer step alone, each the max over ranks, median over repeats.
DP=4 variants: AdamW+DistOpt, Muon+DistOpt (ours: one owner per matrix) with DDP's default (one
bucket here) and with small buckets (``--overlap-grad-reduce``, one or two matrices per bucket,
as at scale), and Muon+DistOpt with the gather-everything baseline (bench/gather_everything.py:
every rank gathers every Muon bucket and orthogonalizes every matrix). Counted figures (exact,
not timed): the plan's parallel efficiency (ideal / critical path; tests tie it to the FLOPs a
real step runs) for both bucket settings and, for comparison, the former bucket-by-bucket
schedule; Newton-Schulz FLOPs per rank, bytes moved per step by the Muon exchange (sent +
received per rank), optimizer state bytes per parameter (the inner optimizers' state tensors
after a step).
"""

import argparse
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from gather_everything import (  # noqa: E402
    GatherEverythingOrthogonalizer,
    distopts,
    use_gather_everything,
)
from harness import run_distributed  # noqa: E402
from tiny_gpt import TinyGPT, build_model, build_optimizer, global_batches, train_step  # noqa: E402

from megatron.training.muon_recipe import SEED_RECIPE  # noqa: E402

MUON = dict(optimizer="muon", muon_fp32_matmul_prec="highest", **SEED_RECIPE)
# elements; with --overlap-grad-reduce DDP cuts the model into buckets of one or two matrices,
# as its 40M-element buckets do on billion-parameter models. Both layouts are timed.
SMALL_BUCKET = 40_000
ADAM = dict(optimizer="adam")
SINGLE = {"adamw": (ADAM, False, None), "muon": (MUON, False, None)}
DP4 = {
    "adamw+distopt": (ADAM, None, None),
    "muon+distopt": (MUON, None, None),
    "adamw+distopt small buckets": (ADAM, None, SMALL_BUCKET),
    "muon+distopt small buckets": (MUON, None, SMALL_BUCKET),
    "muon+gather-everything": (MUON, use_gather_everything, None),
}


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


def _build(spec, overrides, distopt, hook, bucket):
    overlap = bucket is not None
    model = build_model(spec, distopt=distopt, bucket_size=bucket, overlap_grad_reduce=overlap)
    optimizer = build_optimizer(spec, model, use_distributed_optimizer=distopt, **overrides)
    if hook is not None:
        hook(optimizer)
    return model, optimizer


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()


STAT = {"median": statistics.median, "min": min}


def time_variants(spec, variants: dict, distopt: bool, warmup: int, repeats: int, stat: str):
    """({variant: {"iter": s, "opt": s}}, {variant: (model, optimizer)}), interleaved steps."""
    built, opt_times, iter_times = {}, {}, {}
    for name, (overrides, hook, bucket) in variants.items():
        opt_times[name], iter_times[name] = [], []
        model, optimizer = _build(spec, overrides, distopt, hook or None, bucket)
        built[name] = (model, _timed_optimizer(optimizer, opt_times[name]))
    batches = global_batches(spec, warmup + repeats)
    for batch in batches:
        for name, (model, optimizer) in built.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            train_step(spec, model, optimizer, batch)
            iter_times[name].append(time.perf_counter() - start)
    out = {}
    for name in built:
        its = [_max_over_ranks(t) for t in iter_times[name][warmup:]]
        ops = [_max_over_ranks(t) for t in opt_times[name][warmup:]]
        out[name] = {"iter": STAT[stat](its), "opt": STAT[stat](ops)}
    return out, built


# ------------------------------------------------------------------------------ counted figures


def state_bytes(optimizer) -> int:
    """Bytes of every tensor in the inner optimizers' state (created lazily: call after a step)."""
    total = 0
    for inner in (c.optimizer for c in distopts(optimizer)):
        for state in inner.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
    return total


def muon_state_split(optimizer) -> tuple:
    """(Muon state bytes, Muon param elements, AdamW state bytes, AdamW param elements)."""
    out = [0, 0, 0, 0]
    for inner in (c.optimizer for c in distopts(optimizer)):
        for param, state in inner.state.items():
            nbytes = sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
            k = 0 if getattr(inner, "is_muon", lambda p: False)(param) else 2
            out[k] += nbytes
            out[k + 1] += param.numel()
    return tuple(out)


def model_params(model) -> int:
    return sum(p.numel() for chunk in model for p in chunk.parameters())


def exchange_figures(built: dict) -> dict:
    """Counted NS FLOPs and bytes of ours vs the baseline, on this rank (after >= 1 step)."""
    (ours,) = [d for d in distopts(built["muon+distopt"][1]) if hasattr(d, "muon_plan")]
    (base,) = [d for d in distopts(built["muon+gather-everything"][1]) if hasattr(d, "muon_plan")]
    plan = ours.muon_plan
    (small,) = [d for d in distopts(built["muon+distopt small buckets"][1])]
    return {
        "efficiency": {
            "one bucket": plan.efficiency(),
            "small buckets": small.muon_plan.efficiency(),
            "small buckets, bucket by bucket": small.muon_plan.with_window(1).efficiency(),
        },
        "sync_points": small.muon_plan.sync_points(),
        "ns_flops_per_rank": plan.ns_flops_per_rank(),
        "ns_flops_total": sum(m.cost for m in plan.matrices),
        "matrices": len(plan.matrices),
        "bytes_ours": ours.optimizer.orthogonalizer.bytes_moved,
        "bytes_ours_planned": plan.bytes_per_step(4, 4),
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
        "ours": distopt.muon_plan.bytes_per_step(4, 4),
        "baseline": base.bytes_per_step(4),
    }


def run_rank(spec, variants: dict, distopt: bool, warmup: int, repeats: int, stat: str) -> dict:
    times, built = time_variants(spec, variants, distopt, warmup, repeats, stat)
    result = {"times": times, "params": model_params(built[next(iter(built))][0])}
    result["state"] = {name: state_bytes(opt) for name, (_, opt) in built.items()}
    result["split"] = {name: muon_state_split(opt) for name, (_, opt) in built.items()}
    if distopt:
        result.update(exchange_figures(built))
        result["small"] = small_bucket_bytes(spec)
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
    ]


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
    return efficiency + [
        ("DP=4: NS FLOPs per rank max / mean (ours)", max(flops) / mean),
        ("DP=4: NS FLOPs per rank, ours max / baseline", max(flops) / ranks[0]["ns_flops_total"]),
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
    print(f"\nratios (timed: CPU gloo, {args.stat}; counted: exact)")
    print(table(ratios(fig) + counted(fig)))
    return fig


if __name__ == "__main__":
    main()
