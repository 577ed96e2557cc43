"""The end-to-end tests' pre-imported launcher (zygote.py) against real launches: the same
command prints the same losses and grad norms, exits with the same code and the same message.

    .venv/bin/python -m pytest -q tests/e2e/test_launcher.py
"""

from .cli import TINY, losses, run


def test_forked_launches_print_what_real_launches_print():
    args = TINY + ["--train-iters", 2, "--tensor-model-parallel-size", 2, "--optimizer", "muon"]
    real, forked = run(args, nproc=2, torchrun=True), run(args, nproc=2)
    assert losses(forked) == losses(real) and sorted(losses(real)) == [1, 2]
    bad = TINY + ["--hidden-sise", 8]
    real, forked = run(bad, torchrun=True), run(bad)
    assert real.returncode == 2 and "unknown flag --hidden-sise" in real.stderr
    assert (forked.returncode, forked.stderr) == (real.returncode, real.stderr)
