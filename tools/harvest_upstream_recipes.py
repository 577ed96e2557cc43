"""Harvest the flag NAMES of Megatron-LM's GPT and MoE functional-test recipes at one release.

    .venv/bin/python tools/harvest_upstream_recipes.py GIT_DIR [REF] > tests/unit/X.tsv

GIT_DIR: a Megatron-LM git directory (a clone or a bare mirror); REF: a tag or commit (default
core_v0.19.0). Writes one line per
``tests/functional_tests/test_cases/{gpt,moe}/*/model_config.yaml`` at REF: path, commit, the
script that runs it, and the names of its ``MODEL_ARGS`` (flags set to false left out, as
upstream's launcher leaves them out). Names only: no values and no upstream text
leave the checkout.

The script is the ``TRAINING_SCRIPT_PATH`` of the CI recipes (``tests/test_utils/recipes/**.yaml``)
that list the test case on a live (uncommented) line, for the recipe's model; a test case that no
recipe lists at REF is marked ``unlisted`` (its MODEL_ARGS are pretraining flags all the same:
upstream's functional-test launcher runs a model_config with pretrain_gpt.py unless a recipe says
otherwise).
"""

import argparse
import re
import subprocess
import sys

import yaml

CASES = re.compile(r"tests/functional_tests/test_cases/(gpt|moe)/([^/]+)/model_config\.yaml$")


def _git(git_dir: str, *args: str) -> str:
    cmd = ["git", f"--git-dir={git_dir}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def scripts_of(git_dir: str, ref: str, files: list) -> dict:
    """{(model, test case): {script}} from the recipes' live lines."""
    found: dict = {}
    for path in files:
        if not (path.startswith("tests/test_utils/recipes/") and path.endswith(".yaml")):
            continue
        text = _git(git_dir, "show", f"{ref}:{path}")
        script = re.search(r'TRAINING_SCRIPT_PATH=([^"\s]+)', text)
        model = re.search(r"^\s*model:\s*(\S+)", text, re.M)
        if not (script and model):
            continue
        live = [line for line in text.splitlines() if not line.strip().startswith("#")]
        for case in re.findall(r"test_case:\s*\[([^\]]*)\]", "\n".join(live)):
            for name in re.split(r"[\s,]+", case.strip()):
                found.setdefault((model.group(1), name), set()).add(script.group(1))
    return found


def flag_names(model_args: dict) -> list:
    return [name for name, value in model_args.items() if value is not False]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("git_dir", help="a Megatron-LM git directory (clone or bare mirror)")
    parser.add_argument("ref", nargs="?", default="core_v0.19.0", help="a tag or commit")
    args = parser.parse_args(argv)
    git_dir, ref = args.git_dir, args.ref
    commit = _git(git_dir, "rev-parse", f"{ref}^{{commit}}").strip()
    files = _git(git_dir, "ls-tree", "-r", "--name-only", commit, "tests").split()
    scripts = scripts_of(git_dir, commit, files)
    rows, empty = [], []
    for path in sorted(files):
        match = CASES.match(path)
        if not match:
            continue
        config = yaml.safe_load(_git(git_dir, "show", f"{commit}:{path}")) or {}
        names = flag_names(config.get("MODEL_ARGS") or {})
        script = ",".join(sorted(scripts.get(match.groups(), ()))) or "unlisted"
        if not names:
            empty.append(match.group(2))
            continue
        rows.append(f"{path}\t{commit}\t{script}\t{' '.join(names)}")
    print(f"# Flag names of Megatron-LM's GPT/MoE functional-test recipes at {ref} ({commit}),")
    print("# written by tools/harvest_upstream_recipes.py: path<TAB>commit<TAB>script<TAB>flags")
    print("# (names only; flags set to false left out). script: the TRAINING_SCRIPT_PATH of the CI")
    print("# recipes listing the test case, 'unlisted' where none does at this commit.")
    print(f"# Left out, no MODEL_ARGS: {', '.join(empty) or 'none'}")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
