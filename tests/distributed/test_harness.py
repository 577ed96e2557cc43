"""The harness itself: layouts, per-rank failures with tracebacks, no hangs."""

import math

import pytest
import torch
from harness import RankFailure, run_distributed
from parity import misses, worst


def _ranks():
    from megatron.core import parallel_state as ps

    return (
        torch.distributed.get_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_data_parallel_rank(),
    )


def test_layout_tp2_pp2_dp2_covers_every_coordinate():
    out = run_distributed(_ranks, 8, tp=2, pp=2)
    assert [r[0] for r in out] == list(range(8))
    assert sorted({(tp, pp, dp) for _, tp, pp, dp in out}) == [
        (t, p, d) for t in range(2) for p in range(2) for d in range(2)
    ]


def _fail_on_rank_one():
    if torch.distributed.get_rank() == 1:
        raise ValueError("boom on purpose")
    torch.distributed.barrier()  # rank 0 blocks here: the harness must not hang


def test_rank_failure_is_reported_with_its_traceback():
    with pytest.raises(RankFailure, match=r"(?s)rank 1 of 2 failed.*ValueError: boom on purpose"):
        run_distributed(_fail_on_rank_one, 2, timeout=60)


def _sleep_forever():
    import time

    time.sleep(3600)


def test_timeout_kills_ranks_and_names_them():
    with pytest.raises(RankFailure, match=r"timeout after 2s; ranks \[0, 1\]"):
        run_distributed(_sleep_forever, 2, timeout=2)


def _segfault():
    import ctypes

    if torch.distributed.get_rank() == 1:
        ctypes.string_at(0)  # a native crash, as a gloo thread's SIGSEGV would be
    torch.distributed.barrier()


def test_a_native_crash_prints_its_stack_and_is_reported(capfd):
    reported = r"ranks \[1\] (crashed|died without a report) \(exit -11"
    with pytest.raises(RankFailure, match=reported):
        run_distributed(_segfault, 2, timeout=60)
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err and "_segfault" in err, err[-2000:]


def test_a_nan_update_is_the_worst_error_wherever_it_is():
    """``max`` would skip a NaN that is not first (NaN compares False) and pass a parity test
    whose later param went NaN; ``worst`` reports it, and a negative control counts it as a
    miss."""
    errors = {"embedding": 1e-6, "fc1": math.nan, "fc2": 2e-6}
    assert max(errors.values()) == 2e-6  # the trap
    assert worst(errors)[0] == "fc1" and misses(errors, 1.0)
    assert worst({"a": 1e-6, "b": 2e-6}) == ("b", 2e-6) and not misses({"a": 1e-6}, 1e-4)
