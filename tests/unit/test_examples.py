"""Each example script builds its launch command in dry-run mode; the pretrain_gpt.py flags in it
parse with our arguments.py at the world size the launcher would start."""

import os
import shlex
import subprocess

import pytest

from megatron.training.arguments import parse_args

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
