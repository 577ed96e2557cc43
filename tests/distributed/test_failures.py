"""The failure broadcast on gloo ranks: the failing rank's line reaches every other rank, which
says which rank failed and stops, while its main thread is still busy (bounded timeout)."""

import time

import torch
from harness import run_distributed


def _one_rank_fails(poll_s):
    from megatron.training import failures

    lines, exits = [], []
    failures._print = lines.append
    guard = failures.FailureBroadcast("prog", poll_s=poll_s)
    guard.exit = exits.append  # instead of os._exit: the test reads what happened
    guard.start()
    if torch.distributed.get_rank() == 1:
        guard.fail("checkpoint error: file x is truncated")
    else:
        deadline = time.monotonic() + 30  # stands for a collective that never returns
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
        guard.stop()
    return lines, exits


def test_every_other_rank_names_the_failed_rank_and_stops():
    (lines0, exits0), (lines1, exits1), (lines2, exits2) = run_distributed(
        _one_rank_fails, 3, args=(0.1,), timeout=60
    )
    assert lines1 == ["prog: rank 1: checkpoint error: file x is truncated"] and not exits1
    for rank, (lines, exits) in ((0, (lines0, exits0)), (2, (lines2, exits2))):
        assert lines == [
            f"prog: rank {rank}: stopping: rank 1 failed: checkpoint error: file x is truncated"
        ]
        assert exits == [1]


def _quiet_run(poll_s):
    from megatron.training import failures

    lines = []
    failures._print = lines.append
    guard = failures.FailureBroadcast("prog", poll_s=poll_s).start()
    time.sleep(0.5)
    torch.distributed.barrier()
    guard.stop()
    return lines


def test_no_failure_prints_nothing():
    assert run_distributed(_quiet_run, 2, args=(0.05,), timeout=60) == [[], []]
