"""Optimizer-step time at TP 2 x DP 2 (4 gloo CPU ranks, bf16 model): the ``owner`` and
``distributed`` TP modes vs ``duplicated``, ours inside the DistributedOptimizer beside upstream's
LayerWise Muon (its TP mode ``duplicated``), and ``owner`` and ``duplicated`` under plain DDP (no
DistOpt: ``duplicated`` runs every matrix on every rank, ``owner`` each once over the grid).

    .venv/bin/python bench/tp_owner_step.py              # 4-layer GPT, hidden 256, 15 timed steps
    .venv/bin/python bench/tp_owner_step.py --repeats 6  # quicker, wider ranges

bench/step_cost.py's model and timing (steps interleaved A, B, C, A, ...; each the max over
ranks; medians of the per-step ratios, so load from other processes hits all variants alike).
A measurement on whatever CPU runs it: ratios, not asserted anywhere.
"""

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

from harness import run_distributed  # noqa: E402
from step_cost import MUON, UPSTREAM_MUON, Variant, spec_for, time_variants  # noqa: E402

DISTOPT = {
    "owner": Variant({**MUON, "muon_tp_mode": "owner"}, dtype="bf16", muon_layout=True),
    "duplicated": Variant({**MUON, "muon_tp_mode": "duplicated"}, dtype="bf16", muon_layout=True),
    "distributed": Variant({**MUON, "muon_tp_mode": "distributed"}, dtype="bf16", muon_layout=True),
    "layerwise": Variant(UPSTREAM_MUON, dtype="bf16", layer_wise=True),
}
DDP = {
    "owner ddp": Variant({**MUON, "muon_tp_mode": "owner"}, dtype="bf16"),
    "duplicated ddp": Variant({**MUON, "muon_tp_mode": "duplicated"}, dtype="bf16"),
}
PAIRS = [
    ("owner", "duplicated"),
    ("owner", "layerwise"),
    ("duplicated", "layerwise"),
    ("distributed", "duplicated"),
    ("distributed", "layerwise"),
    ("distributed", "owner"),
    ("owner ddp", "duplicated ddp"),
]


def run_rank(warmup: int, repeats: int) -> dict:
    spec = spec_for(False)
    out = {}
    for variants, distopt in ((DISTOPT, True), (DDP, False)):
        times, _, _ = time_variants(spec, variants, distopt, warmup, repeats, "median")
        out.update({name: (t["opt"], t["opts"]) for name, t in times.items()})
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    a = parser.parse_args(argv)
    got = run_distributed(run_rank, 4, tp=2, args=(a.warmup, a.repeats))[0]
    print("TP 2 x DP 2, bf16, CPU gloo; optimizer step, median over ranks' max per step (ms):")
    for name, (median, _) in got.items():
        print(f"  {name:16s} {median * 1e3:8.1f}")
    print("ratios (median of per-step ratios, [min, max]):")
    for a_, b in PAIRS:
        r = [x / y for x, y in zip(got[a_][1], got[b][1])]
        print(f"  {a_} / {b}: {statistics.median(r):.2f} [{min(r):.2f}, {max(r):.2f}]")
    return got


if __name__ == "__main__":
    main()
