"""Every benchmark in one run, ending with one table of ratios.

    make bench                                  # = .venv/bin/python bench/run_all.py --quick
    .venv/bin/python bench/run_all.py           # full step cost + full convergence study (long)

``--quick`` (under 5 minutes on 2 cores): step cost with a 2-layer hidden-256 GPT, the
convergence study on a tiny GPT for 40 steps at one lr per optimizer and one seed, stdlib corpus
only (written to a temp folder, not to bench/results), the projection table. Without
``--quick`` the convergence study rewrites bench/results/ (32 runs, about 1 h on 2 quiet cores).
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import convergence  # noqa: E402
import projection  # noqa: E402
import step_cost  # noqa: E402

PROJECTED_DP = 256


def projection_rows() -> list[tuple]:
    rows = []
    for model in projection.MODELS:
        r = projection.project(model, PROJECTED_DP, projection.parse_args([]))
        label = f"PROJECTION {model}, DP={PROJECTED_DP}: Muon overhead / model step"
        rows.append((f"{label}, ours", (r["ns"] + r["comm"]) / r["step"]))
        base = r["base_ns"] + r["base_tp"] + r["base_comm"]  # NS, TP collectives, all-gather
        rows.append((f"{label}, gather-everything", base / r["step"]))
    return rows


def convergence_rows(summary: dict) -> list[tuple]:
    frac = summary["fraction"]
    return [
        (
            "convergence: Muon's schedule (cosine to its end) reaching AdamW's final val loss / "
            "AdamW steps, worst seed (an upper bound when the shortest schedule run gets there)",
            frac or float("nan"),
        ),
        (
            "convergence: final val loss, Muon / AdamW (best lr each)",
            summary["muon_final"] / summary["target"],
        ),
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="under 5 minutes on 2 cores")
    args = parser.parse_args(argv)
    quick = ["--quick"] if args.quick else []
    start = time.perf_counter()
    print("== step cost", flush=True)
    fig = step_cost.main(quick)
    print("\n== convergence", flush=True)
    summary = convergence.main(quick)
    print("\n== projection", flush=True)
    projection.main([])
    rows = step_cost.ratios(fig) + step_cost.counted(fig)
    rows += convergence_rows(summary) + projection_rows()
    print(
        f"\n== summary ({'quick' if args.quick else 'full'}, {time.perf_counter() - start:.0f} s)"
    )
    print(step_cost.table(rows))


if __name__ == "__main__":
    main()
