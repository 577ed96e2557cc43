"""The harness itself: layouts, per-rank failures with tracebacks, no hangs; and the parity
runs' replica check (``tiny_gpt.gather_all_params``): every rank's copy of a param is compared."""

import math
import re

import pytest
import torch
from harness import RankFailure, run_distributed
from parity import misses, worst
from tiny_gpt import merge_replicas


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


def _gather(off_rank, sharded):
    """A fresh TinyGPT's merged params, with one element of its first TP-sharded (or, with
    ``sharded`` False, TP-replicated) param moved by one ulp on rank ``off_rank`` (None: none)."""
    from tiny_gpt import TinyGPT, build_model, gather_all_params

    spec = TinyGPT()
    model = build_model(spec)
    named = model[0].module.named_parameters()
    name, param = next(
        (n, p) for n, p in named if getattr(p, "tensor_model_parallel", False) == sharded
    )
    if torch.distributed.get_rank() == off_rank:
        with torch.no_grad():
            flat = param.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(math.inf, dtype=flat.dtype))
    return name, sorted(gather_all_params(model, spec))


# TP2 x DP2: ranks (0, 1) and (2, 3) are TP groups, (0, 2) and (1, 3) DP groups. A sharded
# param's gather on rank 0 holds rank 1's shard, so rank 3's shard off shows in rank 2's copy;
# a replicated one (a norm weight) is each rank's own.
CASES = {"dp_replica_of_a_shard": (True, 3, 2), "tp_peer_of_a_replicated_param": (False, 1, 1)}


@pytest.mark.parametrize("case", CASES)
def test_one_replica_one_ulp_off_fails_the_replica_check(case):
    """Parity runs compare one merged copy with the reference: that stands for every rank's only
    because the merge fails on any copy that differs. With no rank off, all params merge."""
    sharded, off_rank, seen_on = CASES[case]
    (name, names), *_ = run_distributed(_gather, 4, tp=2, args=(None, sharded))
    assert len(names) > 10 and name in names
    message = rf"{re.escape(name)}: rank {seen_on}'s copy differs from rank 0's \(max abs"
    with pytest.raises(RankFailure, match=message):
        run_distributed(_gather, 4, tp=2, args=(off_rank, sharded))


def test_replicas_are_compared_bit_for_bit():
    nan, zero = torch.tensor([math.nan, 1.0]), torch.tensor([0.0])
    assert set(merge_replicas([{"w": nan, "z": zero}, {"w": nan.clone()}])) == {"w", "z"}
    with pytest.raises(AssertionError, match="z: rank 1's copy differs from rank 0's"):
        merge_replicas([{"z": zero}, {"z": -zero}])
