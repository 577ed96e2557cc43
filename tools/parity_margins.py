#!/usr/bin/env python3
"""Parity margins under the summation orders another machine could produce.

    .venv/bin/python tools/parity_margins.py [--reports DIR] [--settings default/1,...] [paths]

(paths default to tests/distributed; DIR keeps each setting's report, and a setting whose report
is already there is not run again; --settings picks some of CAPABILITY/THREADS.)

Runs the parity tests once per setting (ATEN_CPU_CAPABILITY default / avx2 / avx512 where the CPU
has it, 1 and 2 intra-op threads per rank) with PARITY_REPORT set (tests/parity.py records every
check), then prints per test the worst parity error / bound over all settings (must stay <= 0.5:
2x margin) and the smallest negative-control error / bound (a control's bound is already 100x or
more the parity tolerance; NaN counts as inf).
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def capabilities() -> list:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    caps = ["default", "avx2"] if " avx2" in flags else ["default"]
    return caps + (["avx512"] if " avx512f" in flags else [])


def run(paths: list, cap: str, threads: int, report: Path) -> int:
    env = dict(os.environ, ATEN_CPU_CAPABILITY=cap, TEST_RANK_THREADS=str(threads))
    # 2 threads x 8 ranks on 2 cores: spinning OpenMP workers would take 3x longer (same numbers)
    env.update(PARITY_REPORT=str(report), OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths]
    print(f"== ATEN_CPU_CAPABILITY={cap} TEST_RANK_THREADS={threads}", flush=True)
    partial = report.with_suffix(".part")  # a run cut short leaves no report to reuse
    partial.unlink(missing_ok=True)
    env["PARITY_REPORT"] = str(partial)
    code = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    partial.touch()
    partial.rename(report)
    return code


def table(rows: list) -> str:
    parity = collections.defaultdict(lambda: (-1.0, ""))
    control = collections.defaultdict(lambda: (float("inf"), "~"))
    for r in rows:
        if "test_harness.py" in r["test"]:  # the helpers' own checks, on made-up numbers
            continue
        ratio = r["error"] / r["bound"] if r["error"] == r["error"] else float("inf")
        key, where = r["test"], f"{r['param']} @ {r['setting']}"
        if r["kind"] == "control":
            control[key] = min(control[key], (ratio, where))
        else:
            parity[(key, r["kind"])] = max(parity[(key, r["kind"])], (ratio, where))
    lines = ["| test | check | worst error / bound | where |", "| --- | --- | --- | --- |"]
    for (test, kind), (ratio, where) in sorted(parity.items()):
        flag = "  **< 2x margin**" if ratio > 0.5 else ""
        lines.append(f"| {test} | {kind} | {ratio:.3f}{flag} | {where} |")
    for test, (ratio, where) in sorted(control.items()):
        flag = "  **weak control**" if ratio < 2 else ""
        lines.append(f"| {test} | control | {ratio:.3g}{flag} | {where} |")
    return "\n".join(lines)


def main(argv: list) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=Path, help="keep the reports here (and reuse them)")
    parser.add_argument("--settings", help="comma-separated CAPABILITY/THREADS, e.g. avx2/2")
    parser.add_argument("paths", nargs="*", default=["tests/distributed"])
    args = parser.parse_args(argv)
    settings = [(cap, threads) for cap in capabilities() for threads in (1, 2)]
    if args.settings:
        settings = [(c, int(t)) for c, t in (s.split("/") for s in args.settings.split(","))]
    with tempfile.TemporaryDirectory() as tmp:
        reports = args.reports or Path(tmp)
        reports.mkdir(parents=True, exist_ok=True)
        failed = [
            f"{cap}/{threads}"
            for cap, threads in settings
            if not (reports / f"{cap}-{threads}.jsonl").exists()
            and run(args.paths, cap, threads, reports / f"{cap}-{threads}.jsonl") != 0
        ]
        rows = [
            dict(json.loads(line), setting=report.stem.replace("-", "/"))
            for report in sorted(reports.glob("*.jsonl"))
            for line in report.read_text().splitlines()
        ]
    print(table(rows))
    print(f"settings with failures: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
