"""Megatron-LM's own GPT/MoE recipes meet only flags that pretrain_gpt.py knows.

``upstream_recipes.tsv`` holds the flag sets of Megatron-LM's functional-test recipes and example
launch scripts (repository, path and commit per recipe; names only), a sample of several commits.
``upstream_recipes_core_v0.19.0.tsv`` holds every GPT and MoE functional-test recipe of
core_v0.19.0 (``tools/harvest_upstream_recipes.py``) with the script its CI recipe runs it with;
the pretraining recipes are those run by ``pretrain_gpt.py`` (and those no CI recipe lists at
that tag), not the inference and RL ones.

Parse-only: each name is looked up in the installed parser (upstream's ``add_megatron_arguments``,
with the flags our patches add), no launch. Refused are the variants ``gpt_entry`` does not build
(``REFUSED``: "other") and, where Transformer Engine is absent, what only TE provides
(``NEEDS_TE``: "needs CUDA/TE", allowed by the goal: on a machine with TE they run as upstream's).
The report (known fraction, the fraction that would start, the refusals of either kind):

    .venv/bin/python tests/unit/test_upstream_recipes.py
"""

import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, also when run as a script
from cli_config import known_flags  # noqa: E402

from megatron.training import gpt_entry  # noqa: E402

DATA = Path(__file__).with_name("upstream_recipes.tsv")
DATA_V19 = Path(__file__).with_name("upstream_recipes_core_v0.19.0.tsv")
CORE_V0_19_0 = "5be9626709af2722333bf54797c954c09edeada3"
PRETRAINING = ("pretrain_gpt.py", "unlisted")  # the scripts of core_v0.19.0's pretraining recipes
KNOWN_GOAL = 0.90  # of the sample (older commits too), the recipes whose flags 0.19 still has
# Of core_v0.19.0's pretraining recipes, those that start with nothing refused but what needs
# CUDA/TE (the project's goal for the fork's pretrain_gpt.py)
START_GOAL = 0.90
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


def flag_states(names: set) -> dict:
    """Per flag name: None (unknown), "refused" (pretrain_gpt.py does not build it), "needs_te"
    (refused only where Transformer Engine is absent) or "ok"."""
    refused = {flag for flag, _ in gpt_entry.REFUSED}
    needs_te = {flag for flag, *_ in gpt_entry.NEEDS_TE}
    return {
        n: None
        if n not in known_flags()
        else "refused"
        if n in refused
        else "needs_te"
        if n in needs_te
        else "ok"
        for n in names
    }


def recipes(data: Path = DATA, scripts=None) -> list:
    """[(path, commit, [flag names])] of a data file (of the v0.19.0 file: of those ``scripts``
    run, all where None)."""
    rows = []
    for line in data.read_text().splitlines():
        if line and not line.startswith("#"):
            path, commit, *script, flags = line.split("\t")
            if scripts is None or script[0] in scripts:
                rows.append((path, commit, flags.split()))
    return rows


def summary(rows) -> dict:
    """How many recipes use only known flags, how many also no refused flag (startable), how many
    no refused flag but what needs CUDA/TE (startable_with_te), and per flag the number of recipes
    it blocks (unknown, refused, needs_te)."""
    known = startable = startable_with_te = 0
    unknown, refused, needs_te = (collections.Counter() for _ in range(3))
    for _, _, names in rows:
        states = flag_states(set(names))
        missing = {n for n, s in states.items() if s is None}
        blocked = {n for n, s in states.items() if s == "refused" or n in REFUSED_BY_VALUE}
        te_only = {n for n, s in states.items() if s == "needs_te"}
        unknown.update(missing)
        refused.update(blocked)
        needs_te.update(te_only)
        known += not missing
        startable += not (missing or blocked or te_only)
        startable_with_te += not (missing or blocked)
    return dict(
        total=len(rows),
        known=known,
        startable=startable,
        startable_with_te=startable_with_te,
        unknown=unknown,
        refused=refused,
        needs_te=needs_te,
    )


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


def test_core_v0_19_0_set_is_every_gpt_and_moe_recipe_of_the_tag():
    every = recipes(DATA_V19)
    pretraining = recipes(DATA_V19, PRETRAINING)
    # 267 of the tag's 268 gpt/moe model_config.yaml (one without MODEL_ARGS), 212 pretraining
    assert len(every) >= 260 and len(pretraining) >= 200, (len(every), len(pretraining))
    assert {commit for _, commit, _ in every} == {CORE_V0_19_0}
    assert {p.split("/")[3] for p, _, _ in pretraining} == {"gpt", "moe"}
    assert all(all(n.startswith("--") for n in names) and names for *_, names in every)


def test_core_v0_19_0_pretraining_recipes_start_but_for_what_needs_cuda_or_te():
    """>= 90% of core_v0.19.0's pretraining recipes use only known flags and no flag the entry
    refuses; the NEEDS_TE flags (fp8/fp4, TE-only attention variants) count as allowed: where TE
    is installed the entry hands them to upstream's code. The ones that do not start today:
    ModelOpt distillation (--export-*: Megatron-LM's megatron/post_training, not in the
    megatron-core archive, so not in the parser)."""
    r = summary(recipes(DATA_V19, PRETRAINING))
    assert r["startable_with_te"] / r["total"] >= START_GOAL, report(DATA_V19, PRETRAINING)
    assert not r["refused"], r["refused"]  # every "other" refusal of the set is lifted


def test_a_refused_flag_counts_against_its_recipe_and_a_te_one_only_without_te():
    """Negative control of the goal's count: a REFUSED flag blocks its recipe; a NEEDS_TE one
    blocks ``startable`` but not ``startable_with_te``."""
    path, commit, names = recipes(DATA_V19, PRETRAINING)[0]
    assert summary([(path, commit, names)])["startable"] == 1
    other = summary([(path, commit, names + [gpt_entry.REFUSED[0][0]])])
    assert (other["startable"], other["startable_with_te"]) == (0, 0)
    te = summary([(path, commit, names + ["--fp8-format"])])
    assert (te["startable"], te["startable_with_te"]) == (0, 1)


def report(data: Path = DATA, scripts=None) -> str:
    r = summary(recipes(data, scripts))

    def top(counter):
        return ", ".join(f"{name} ({n})" for name, n in counter.most_common(12)) or "none"

    total = r["total"]
    return (
        f"{data.name}{'' if scripts is None else ' ' + '/'.join(scripts)}: {total} recipes: "
        f"{r['known']} ({r['known'] / total:.1%}) use only known flags; {r['startable']} "
        f"({r['startable'] / total:.1%}) no refused flag; {r['startable_with_te']} "
        f"({r['startable_with_te'] / total:.1%}) none but what needs CUDA/TE\n"
        f"  unknown (recipes): {top(r['unknown'])}\n  refused, other: {top(r['refused'])}\n"
        f"  refused, needs CUDA/TE: {top(r['needs_te'])}"
    )


if __name__ == "__main__":
    print(report())
    print(report(DATA_V19, PRETRAINING))
