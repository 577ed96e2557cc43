"""Each example script builds its launch command in dry-run mode; the pretrain_gpt.py flags in it
parse with our arguments.py at the world size the launcher would start."""

import os
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
