"""Megatron-LM's own GPT/MoE recipes meet only flags that pretrain_gpt.py knows.

``upstream_recipes.tsv`` holds the flag sets of Megatron-LM's functional-test recipes and example
launch scripts (repository, path and commit per recipe; names only). Parse-only: each name is
looked up in the installed parser (upstream's ``add_megatron_arguments``, with the flags our
patches add), no launch; refused are the variants ``gpt_entry`` does not build. The report (known
fraction, the fraction that would start, the most frequent refusals):

    .venv/bin/python tests/unit/test_upstream_recipes.py
"""

import argparse
import collections
import functools
import re
from pathlib import Path

from megatron.training import arguments, gpt_entry

DATA = Path(__file__).with_name("upstream_recipes.tsv")
KNOWN_GOAL = 0.90  # of the sample (older commits too), the recipes whose flags 0.19 still has
# Flags of older recipes that upstream's own parser no longer has (so neither has the fork's):
# --use-legacy-models and --no-async-tensor-model-parallel-allreduce (in core_v0.16.1's CLI, gone
# in core_v0.19.0's), --tokenizer-library (NeMo's, in no Megatron-LM release's parser)
REMOVED_UPSTREAM = {
    "--use-legacy-models",
    "--no-async-tensor-model-parallel-allreduce",
    "--tokenizer-library",
}
# Flags accepted with some values only (the data file holds names only): none at present
# (--rerun-mode takes all three of upstream's values since the rerun state machine is wired).
REFUSED_BY_VALUE: set = set()


@functools.cache
def _known() -> frozenset:
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    return frozenset(parser._option_string_actions)


def flag_states(names: set) -> dict:
    """Per flag name: None (unknown), "refused" (pretrain_gpt.py does not build it) or "ok"."""
    refused = {flag for flag, _ in gpt_entry.REFUSED}
    return {n: None if n not in _known() else "refused" if n in refused else "ok" for n in names}


def recipes() -> list:
    """[(path, commit, [flag names])] of the data file."""
    rows = []
    for line in DATA.read_text().splitlines():
        if line and not line.startswith("#"):
            path, commit, flags = line.split("\t")
            rows.append((path, commit, flags.split()))
    return rows


def summary(rows) -> dict:
    """How many recipes use only known flags, how many also no refused flag, and per flag the
    number of recipes it blocks (unknown or refused)."""
    known = startable = 0
    unknown, refused = collections.Counter(), collections.Counter()
    for _, _, names in rows:
        states = flag_states(set(names))
        missing = {n for n, s in states.items() if s is None}
        blocked = {n for n, s in states.items() if s == "refused" or n in REFUSED_BY_VALUE}
        unknown.update(missing)
        refused.update(blocked)
        known += not missing
        startable += not missing and not blocked
    return dict(total=len(rows), known=known, startable=startable, unknown=unknown, refused=refused)


def test_the_sample_is_upstreams_gpt_and_moe_recipes_with_their_commits():
    rows = recipes()
    kinds = collections.Counter(
        "gpt" if "/gpt/" in p else "moe" if "/moe/" in p else "example" for p, _, _ in rows
    )
    assert len(rows) >= 50 and min(kinds.values()) >= 8, kinds
    assert all(re.fullmatch(r"[0-9a-f]{40}", commit) for _, commit, _ in rows)
    assert len({commit for _, commit, _ in rows}) >= 20  # several releases, not one snapshot
    assert all(all(n.startswith("--") for n in names) and len(names) > 10 for *_, names in rows)


def test_upstream_recipes_use_only_known_flags_but_those_upstream_removed():
    result = summary(recipes())
    assert result["known"] / result["total"] >= KNOWN_GOAL, result["unknown"]
    assert set(result["unknown"]) <= REMOVED_UPSTREAM, result["unknown"]


def test_a_flag_the_table_lacks_counts_against_its_recipe():  # negative control of the count
    path, commit, names = recipes()[0]
    before = summary([(path, commit, names)])
    after = summary([(path, commit, names + ["--not-a-megatron-flag"])])
    assert (before["known"], after["known"]) == (1, 0)
    assert after["unknown"] == {"--not-a-megatron-flag": 1}


def report() -> str:
    r = summary(recipes())
    top = ", ".join(f"{name} ({n})" for name, n in r["refused"].most_common(12))
    return (
        f"{r['total']} recipes: {r['known']} ({r['known'] / r['total']:.0%}) use only known "
        f"flags; {r['startable']} ({r['startable'] / r['total']:.0%}) use no refused flag\n"
        f"unknown: {dict(r['unknown']) or 'none'}\nmost frequent refusals (recipes): {top}"
    )


if __name__ == "__main__":
    print(report())
