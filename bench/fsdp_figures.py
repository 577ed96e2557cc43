"""Counted figures of our Muon under ZeRO-3 (Megatron-FSDP) against AdamW under it and against our
Muon under the DistributedOptimizer (ZeRO-1), per rank and step, on gloo CPU ranks.

    .venv/bin/python bench/fsdp_figures.py            # DP 2, tiny GPT (~20 s)
    .venv/bin/python bench/fsdp_figures.py --dp 4

Counted, not timed: each variant trains two steps of a real Megatron GPT (tests/tiny_gpt.py) and
the second step's collectives are recorded as they are called (bench/collectives.py: bytes a rank
sends plus receives, ring model, own data excluded). Per rank: bytes of the whole step and of the
Muon exchange alone (its all-to-alls), optimizer state bytes and main-param bytes (this rank's
pieces), the model-weight bytes it keeps between steps, and Newton-Schulz FLOPs from the plan the
optimizer executes (``planner.figures.ns_flops_per_rank``; tests/distributed/test_fsdp_muon.py
ties them to the matrices a real step orthogonalizes).
"""

import argparse
import os
import sys
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
}
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


def model_weight_bytes(model, kind: str) -> int:
    """Bytes of model weights this rank keeps between steps: Megatron-FSDP's model-weight buffers
    (sharded under optim_grads_params), else DDP's param buffers (whole params)."""
    if kind == "megatron_fsdp":
        groups = model[0].module.param_and_grad_buffer.parameter_groups
        return sum(
            _local_bytes([g.model_weight_buffer.data]) for g in groups if g.model_weight_buffer
        )
    return sum(
        _local_bytes([b.param_data]) for c in model for b in c.buffers + c.expert_parallel_buffers
    )


def counts(spec: TinyGPT, kind: str, settings: dict, hook=None) -> dict:
    """One variant's counted figures on this rank (after its second step); ``hook(optimizer)``
    runs once it is built (tests watch the step through it)."""
    model, optimizer = build(spec, kind, settings)
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
        model_weight_bytes=model_weight_bytes(model, kind),
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


def run_rank(spec: TinyGPT) -> dict:
    return {name: counts(spec, kind, settings) for name, (kind, settings) in VARIANTS.items()}


def measure(dp: int, spec: TinyGPT | None = None) -> list[dict]:
    return run_distributed(run_rank, dp, args=(spec or TinyGPT(),))


def table(ranks: list[dict]) -> str:
    keys = list(ranks[0][next(iter(VARIANTS))])
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
    args = parser.parse_args(argv)
    ranks = measure(args.dp)
    print(f"tiny GPT, DP {args.dp}, Megatron-FSDP {STRATEGY}, fp32, second step\n")
    print(table(ranks))
    return ranks


if __name__ == "__main__":
    main()
