"""Each example script builds its launch command in dry-run mode; the pretrain_gpt.py flags in it
parse with our arguments.py at the world size the launcher would start."""

import ast
import os
import re
import shlex
import subprocess

import pytest
from megatron.training.arguments import parse_args
from megatron.training.core_configs import optimizer_config

from megatron.training.muon_recipe import SEED_RECIPE, SEED_RECIPE_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# script, environment, expected launcher words, world size
EXAMPLES = [
    ("examples/cpu_quickstart.sh", {}, ["--standalone", "--use-distributed-optimizer"], 4),
    ("examples/cpu_quickstart.sh", {"DISTOPT": "0"}, ["--nproc-per-node", "4"], 4),
    ("examples/train_single_node.sh", {"GPUS": "8"}, ["--nproc-per-node", "8", "--standalone"], 8),
    (
        "examples/slurm_multinode.sbatch",
        {"SLURM_NNODES": "2", "SLURM_JOB_ID": "42", "DATA_PATH": "/data/x"},
        ["srun", "--nnodes", "--rdzv-backend", "c10d", "--rdzv-id", "42"],
        16,
    ),
]


def dry_run(script: str, env: dict) -> list:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update(env, DRY_RUN="1")
    out = subprocess.run(
        ["bash", os.path.join(ROOT, script)],
        env=full_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return shlex.split(out)


@pytest.mark.parametrize("script, env, launcher, world_size", EXAMPLES)
def test_example_command_parses(script, env, launcher, world_size):
    words = dry_run(script, env)
    entry = words.index("pretrain_gpt.py")
    for word in launcher:
        assert word in words[:entry] + words[entry : entry + 1] or word in words
    args = parse_args(words[entry + 1 :], world_size=world_size)
    assert args.optimizer == "muon"


def test_header_states_the_command():
    for script, *_ in EXAMPLES:
        header = open(os.path.join(ROOT, script)).read().split("set -euo")[0]
        assert "DRY_RUN=1 bash " + script in header


def test_recipe_flags_set_the_recipe_fields():
    args = parse_args(
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data "
        "--optimizer muon".split()
        + SEED_RECIPE_FLAGS,
        world_size=1,
    )
    config = optimizer_config(args)
    assert {name: getattr(config, name) for name in SEED_RECIPE} == SEED_RECIPE


def test_make_demo_runs_the_seed_recipe():
    words = dry_run("examples/cpu_quickstart.sh", {})
    config = optimizer_config(parse_args(words[words.index("pretrain_gpt.py") + 1 :], world_size=4))
    assert {name: getattr(config, name) for name in SEED_RECIPE} == SEED_RECIPE


def _docstring_launch() -> tuple[int, list]:
    """(ranks, pretrain_gpt.py's flags) of the launch line in pretrain_gpt.py's docstring, the
    built-in corpus's prefix in place of its ``$(... megatron.training.corpus)``."""
    from megatron.training import corpus

    doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, "pretrain_gpt.py")).read()))
    lines = doc.split("Launch", 1)[1].splitlines()[1:]
    command = " ".join(line.rstrip("\\").strip() for line in lines[: _launch_end(lines)])
    command = re.sub(r"\$\(\S+ -m megatron\.training\.corpus\)", corpus.build_corpus(), command)
    words = shlex.split(command)
    ranks = int(words[words.index("--nproc-per-node") + 1])
    return ranks, words[words.index("pretrain_gpt.py") + 1 :]


def _launch_end(lines: list) -> int:
    return next(i for i, line in enumerate(lines) if not line.rstrip().endswith("\\")) + 1


def test_pretrain_gpt_docstring_launch_fits_the_builtin_corpus():
    """The docstring's launch line runs as written: every split it reads has documents of the
    built-in corpus (233 documents; start-up checks this and refuses an empty needed split)."""
    from megatron.training import datasets

    ranks, flags = _docstring_launch()
    args = parse_args(flags, world_size=ranks)
    config = _pretrain_gpt().dataset_config(args, _pretrain_gpt().tokenizer_from_args(args))
    samples = datasets.train_valid_test_num_samples(
        args.train_iters, args.global_batch_size, args.eval_interval, args.eval_iters
    )
    datasets.check_splits_have_documents(config, samples)


def _pretrain_gpt():
    import importlib.util
    import sys

    if "pretrain_gpt" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "pretrain_gpt", os.path.join(ROOT, "pretrain_gpt.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["pretrain_gpt"] = module
        spec.loader.exec_module(module)
    return sys.modules["pretrain_gpt"]
