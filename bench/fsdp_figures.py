"""Our Muon under ZeRO-3 (Megatron-FSDP) against AdamW under it, and both under the
DistributedOptimizer (ZeRO-1), per rank and step, on gloo CPU ranks: counted figures and timings.

    .venv/bin/python bench/fsdp_figures.py            # DP 2, tiny GPT (~1 min)
    .venv/bin/python bench/fsdp_figures.py --dp 4 --repeats 20

Counted: each variant trains two steps of a real Megatron GPT (tests/tiny_gpt.py) and the second
step's collectives are recorded as they are called (bench/collectives.py: bytes a rank sends plus
receives, ring model, own data excluded). Per rank: bytes of the whole step and of the Muon
exchange alone (its all-to-alls), optimizer state bytes and main-param bytes (this rank's
pieces), the param bytes it keeps between steps (the model weights: ZeRO-3 keeps a shard,
DistOpt the whole), and Newton-Schulz FLOPs from the plan the optimizer executes
(``planner.figures.ns_flops_per_rank``; tests/distributed/test_fsdp_muon.py ties them to the
matrices a real step orthogonalizes).

Timed: the four variants, built side by side in the same processes, then train ``--repeats``
more steps interleaved (A, B, C, D, A, ...), so load from other jobs hits each alike; per step
the iteration (forward, backward, grad sync, optimizer step) and ``optimizer.step()`` alone, max
over ranks. Reported as paired ratios (each repeat's Muon time over AdamW's of the same round):
median [min-max]. Timings are for this bench only; no test asserts them.
"""

import argparse
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [
    HERE,
    os.path.join(os.path.dirname(HERE), "tests"),
    os.path.join(HERE, "..", "tests", "distributed"),
]
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from collectives import CollectiveRecorder  # noqa: E402
from collectives import total as recorded_bytes  # noqa: E402
from harness import run_distributed  # noqa: E402
from step_cost import _max_over_ranks, _timed_optimizer  # noqa: E402
from tiny_gpt import TinyGPT, build_model, build_optimizer, global_batches, train_step  # noqa: E402

from megatron.core.optimizer.megatron_muon import fsdp  # noqa: E402
from megatron.core.optimizer.megatron_muon.planner import figures as plan_figures  # noqa: E402
from megatron.training.muon_recipe import SEED_RECIPE  # noqa: E402

MUON = dict(optimizer="muon", muon_fp32_matmul_prec="highest", **SEED_RECIPE)
ADAM = dict(optimizer="adam")
VARIANTS = {
    "muon_fsdp": ("megatron_fsdp", MUON),
    "adamw_fsdp": ("megatron_fsdp", ADAM),
    "muon_distopt": ("distopt", MUON),
    "adamw_distopt": ("distopt", ADAM),
}
# (Muon variant, AdamW variant) of each timed ratio
PAIRS = (("muon_fsdp", "adamw_fsdp"), ("muon_distopt", "adamw_distopt"))
STRATEGY = "optim_grads_params"


def _local_bytes(tensors) -> int:
    return sum(fsdp.local(t).numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def _inner(optimizer):
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def build(spec: TinyGPT, kind: str, settings: dict):
    """(model chunks, optimizer) of one variant."""
    from test_fsdp_muon import build_megatron_fsdp

    if kind == "megatron_fsdp":
        model = build_megatron_fsdp(spec, STRATEGY)
    else:
        model = build_model(spec, distopt=True, overlap_grad_reduce=True, muon_layout=False)
    return model, build_optimizer(spec, model, use_distributed_optimizer=True, **settings)


def plans(optimizer) -> list:
    """The exchange plans the optimizer executes (FSDP: one per DP group; DistOpt: its own)."""
    out = []
    for inner, outer in zip(
        _inner(optimizer), getattr(optimizer, "chained_optimizers", [optimizer])
    ):
        ortho = getattr(inner, "orthogonalizer", None)
        if isinstance(ortho, fsdp.Zero3Orthogonalizer):
            out += [ex.plan for ex in ortho.exchanges]
        elif getattr(outer, "muon_plan", None) is not None:
            out.append(outer.muon_plan)
    return out


def param_bytes(model, kind: str) -> int:
    """Bytes of model params (weights) this rank keeps between steps: Megatron-FSDP's model-weight
    buffers (sharded under optim_grads_params), else DDP's param buffers (whole params)."""
    if kind == "megatron_fsdp":
        groups = model[0].module.param_and_grad_buffer.parameter_groups
        return sum(
            _local_bytes([g.model_weight_buffer.data]) for g in groups if g.model_weight_buffer
        )
    return sum(
        _local_bytes([b.param_data]) for c in model for b in c.buffers + c.expert_parallel_buffers
    )


def counts(spec: TinyGPT, kind: str, settings: dict, hook=None, keep=None) -> dict:
    """One variant's counted figures on this rank (after its second step); ``hook(optimizer)``
    runs once it is built (tests watch the step through it); ``keep``: a list that gets
    (model, optimizer) to train on."""
    model, optimizer = build(spec, kind, settings)
    if keep is not None:
        keep += [model, optimizer]
    if hook is not None:
        hook(optimizer)
    first, second = global_batches(spec, 2)
    train_step(spec, model, optimizer, first)
    with CollectiveRecorder() as calls:
        train_step(spec, model, optimizer, second)
    inner = _inner(optimizer)
    params = [p for o in inner for g in o.param_groups for p in g["params"]]
    exchange = sum(c.bytes for c in calls if c.op == "all_to_all_single")
    rank_flops = [plan_figures.ns_flops_per_rank(p)[p.rank] for p in plans(optimizer)]
    return dict(
        step_bytes=recorded_bytes(calls),
        exchange_bytes=exchange,
        state_bytes=sum(_local_bytes(s.values()) for o in inner for s in o.state.values()),
        main_param_bytes=_local_bytes(params),
        param_bytes=param_bytes(model, kind),
        ns_flops=sum(rank_flops),
        planned_exchange_bytes=sum(
            plan_figures.bytes_per_step(p, *_exchange_itemsizes(optimizer))
            for p in plans(optimizer)
        ),
    )


def _exchange_itemsizes(optimizer) -> tuple[int, int]:
    """(forward, return) bytes per element of the Muon exchange (4, 4 without Muon)."""
    for inner in _inner(optimizer):
        ortho = getattr(inner, "orthogonalizer", None)
        for ex in getattr(ortho, "exchanges", [ortho]):
            if hasattr(ex, "forward_dtype"):
                return ex.forward_dtype.itemsize, ex.return_dtype.itemsize
    return 4, 4


def run_rank(spec: TinyGPT, repeats: int = 0) -> dict:
    """Every variant's counts, then (``repeats``) their steps timed interleaved."""
    built, out = {}, {}
    for name, (kind, settings) in VARIANTS.items():
        built[name] = []
        out[name] = counts(spec, kind, settings, keep=built[name])
    if repeats:
        for name, times in time_steps(spec, built, repeats).items():
            out[name].update(times)
    return out


def time_steps(spec: TinyGPT, built: dict, repeats: int) -> dict:
    """{variant: {"iters": [...], "opts": [...]}}: each repeat's iteration and optimizer-step
    seconds (max over ranks), the variants' steps interleaved, a barrier before each."""
    opt_times = {name: [] for name in built}
    for name, (_, optimizer) in built.items():
        _timed_optimizer(optimizer, opt_times[name])
    iters = {name: [] for name in built}
    for batch in global_batches(spec, 2 + repeats)[2:]:  # steps 1-2 were the counted ones
        for name, (model, optimizer) in built.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            train_step(spec, model, optimizer, batch)
            iters[name].append(time.perf_counter() - start)
    return {
        name: {
            "iters": [_max_over_ranks(t) for t in iters[name]],
            "opts": [_max_over_ranks(t) for t in opt_times[name]],
        }
        for name in built
    }


def measure(dp: int, spec: TinyGPT | None = None, repeats: int = 0) -> list[dict]:
    return run_distributed(run_rank, dp, args=(spec or TinyGPT(), repeats))


def paired(muon: dict, adamw: dict, key: str) -> tuple:
    """(median, min, max) over the repeats of Muon's time / AdamW's in the same round."""
    r = [m / a for m, a in zip(muon[key], adamw[key])]
    return statistics.median(r), min(r), max(r)


def time_table(ranks: list[dict]) -> str:
    """Timed ratios (rank 0 holds the max over ranks), ours-FSDP / AdamW-FSDP beside
    ours-DistOpt / AdamW-DistOpt, and each variant's median times."""
    r = ranks[0]
    rows = [
        "| time per step (max over ranks) | " + " | ".join(f"{m} / {a}" for m, a in PAIRS) + " |",
        "|---" * (len(PAIRS) + 1) + "|",
    ]
    for key, label in (("opts", "optimizer step"), ("iters", "iteration")):
        cells = ["{:.2f} [{:.2f}-{:.2f}]".format(*paired(r[m], r[a], key)) for m, a in PAIRS]
        rows.append(f"| {label}: Muon / AdamW, median [min-max] | " + " | ".join(cells) + " |")
    rows += ["", "| median ms | " + " | ".join(VARIANTS) + " |", "|---" * (len(VARIANTS) + 1) + "|"]
    for key, label in (("opts", "optimizer step"), ("iters", "iteration")):
        cells = [f"{1e3 * statistics.median(r[v][key]):.1f}" for v in VARIANTS]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def table(ranks: list[dict]) -> str:
    first = ranks[0][next(iter(VARIANTS))]
    keys = [k for k, v in first.items() if not isinstance(v, list)]  # not the timings
    head = "| per rank (max over ranks) | " + " | ".join(VARIANTS) + " |"
    rows = [head, "|---" * (len(VARIANTS) + 1) + "|"]
    for key in keys:
        cells = [max(r[v][key] for r in ranks) for v in VARIANTS]
        unit = "MFLOP" if key == "ns_flops" else "kB"
        scale = 1e6 if key == "ns_flops" else 1e3
        rows.append(f"| {key} ({unit}) | " + " | ".join(f"{c / scale:.1f}" for c in cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks (default 2)")
    parser.add_argument(
        "--repeats", type=int, default=15, help="timed interleaved steps per variant (0: none)"
    )
    args = parser.parse_args(argv)
    ranks = measure(args.dp, repeats=args.repeats)
    print(f"tiny GPT, DP {args.dp}, Megatron-FSDP {STRATEGY}, fp32; counted: second step\n")
    print(table(ranks))
    if args.repeats:
        print(f"\ntimed: steps 3-{2 + args.repeats}, interleaved, paired ratios\n")
        print(time_table(ranks))
    return ranks


if __name__ == "__main__":
    main()
