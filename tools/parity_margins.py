#!/usr/bin/env python3
"""Parity margins under the summation orders another machine could produce.

    .venv/bin/python tools/parity_margins.py [pytest paths...]   # default: tests/distributed

Runs the parity tests once per setting (ATEN_CPU_CAPABILITY default / avx2 / avx512 where the CPU
has it, 1 and 2 intra-op threads per rank) with PARITY_REPORT set (tests/parity.py records every
check), then prints per test the worst parity error / bound over all settings (must stay <= 0.5:
2x margin) and the smallest negative-control error / bound (a control's bound is already 100x or
more the parity tolerance; NaN counts as inf).
"""

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
    env["PARITY_REPORT"] = str(report)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths]
    print(f"== ATEN_CPU_CAPABILITY={cap} TEST_RANK_THREADS={threads}", flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


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
    paths = argv or ["tests/distributed"]
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for cap in capabilities():
            for threads in (1, 2):
                report = Path(tmp) / f"{cap}-{threads}.jsonl"
                if run(paths, cap, threads, report) != 0:
                    failed.append(f"{cap}/{threads}")
                for line in report.read_text().splitlines() if report.exists() else []:
                    rows.append(dict(json.loads(line), setting=f"{cap}/{threads}"))
    print(table(rows))
    print(f"settings with failures: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
