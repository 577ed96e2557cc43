"""The loop's rerun wiring on 2 gloo ranks: a re-run reads the step's micro-batches again (and
the next step the next ones), and every rank re-runs when only one rank rejected a result.
megatron-core's own RerunStateMachine decides; what is tested is rerun.wrap / rerun.steps /
rerun.validate_loss as training.train_step and pretrain_gpt's loss_func use them."""

import argparse
import random

import torch

from tests.harness import run_distributed

ARGS = dict(
    rerun_mode="validate_results",
    error_injection_type="transient_error",
    check_for_nan_in_loss_and_grad=False,
    check_for_spiky_loss=True,  # non-fatal: a transient fault re-runs, then training goes on
)
STEPS, MICRO = 3, 2


def _record(rate: int, break_rewind: bool = False) -> list:
    """Per step, per (re-)run: (the micro-batches read, this rank rejected its result)."""
    from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine

    from megatron.training import rerun

    if break_rewind:  # negative control: a re-run that reads on instead of replaying
        RerunDataIterator.rewind = lambda self: None
    random.seed(0)  # the injector draws from `random`: same stream, so ranks differ by rank alone
    rerun.initialize(argparse.Namespace(**ARGS, error_injection_rate=rate))
    rank = torch.distributed.get_rank()
    data = rerun.wrap(iter(range(100 * rank, 100 * rank + 100)))
    machine, steps = get_rerun_state_machine(), []
    for _ in range(STEPS):
        runs = []
        for _ in rerun.steps(data):
            batches = [next(data) for _ in range(MICRO)]
            # one checked result per (re-)run: with rate 2 exactly one of the two ranks rejects
            rerun.validate_loss(argparse.Namespace(**ARGS), torch.tensor(float(batches[0])))
            runs.append((batches, machine.rerun_requested))
        steps.append(runs)
    return steps


def test_a_rerun_replays_the_steps_batches_and_every_rank_reruns():
    per_rank = run_distributed(_record, 2, args=(2,))
    for rank, steps in enumerate(per_rank):
        first = [runs[0][0] for runs in steps]
        expected = [[100 * rank + MICRO * s + m for m in range(MICRO)] for s in range(STEPS)]
        assert first == expected  # each step reads the next micro-batches, none twice
        assert len(steps[0]) == 1  # nothing is validated before a first optimizer step
        for runs in steps[1:]:
            assert len(runs) == 2 and runs[1][0] == runs[0][0], runs  # same batches again
    rejected = [[runs[0][1] for runs in steps[1:]] for steps in per_rank]
    # in each re-run step one rank rejected and the other re-ran on the all-reduced decision
    assert all(a != b for a, b in zip(*rejected)), rejected


def test_negative_control_without_the_replay_the_rerun_reads_new_batches():
    per_rank = run_distributed(_record, 2, args=(2, True))
    assert all(runs[1][0] != runs[0][0] for steps in per_rank for runs in steps[1:])
