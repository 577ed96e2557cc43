"""LayerWise's all-gather of per-rank parts of different sizes on gloo (patch 0041): synchronous,
and async as the DDP buckets' overlapped param gather issues it, one gather per bucket and one
wait for the bucket group. End to end: tests/e2e/test_upstream_optimizers.py."""

import torch
from harness import run_distributed

SIZES = (3, 7)  # rank r's part has SIZES[r] elements: uneven, which gloo alone refuses


def _gather(async_op: bool, buckets: int, wait=None):
    from megatron.core.optimizer.repairs import uneven_all_gather as uag

    rank = torch.distributed.get_rank()
    group = torch.distributed.group.WORLD
    lists, works = [], []
    for b in range(buckets):
        src = torch.full((SIZES[rank],), 10.0 * b + rank)
        lists.append([torch.full((n,), -1.0) for n in SIZES])
        works.append(uag.all_gather(lists[-1], src, group, async_op=async_op))
    if async_op:
        (wait or uag.wait_all)(works)
    return [[t.tolist() for t in gathered] for gathered in lists]


def _expected(buckets: int) -> list:
    return [[[10.0 * b + r] * n for r, n in enumerate(SIZES)] for b in range(buckets)]


def test_sync_gather_of_uneven_parts():
    assert run_distributed(_gather, 2, args=(False, 1)) == [_expected(1)] * 2


def test_async_gathers_of_a_bucket_group_all_land_after_one_wait():
    assert run_distributed(_gather, 2, args=(True, 3)) == [_expected(3)] * 2


def _wait_last_only(works):
    works[-1].wait()  # upstream's wait (NCCL completes in order); gloo's padded parts need each


def test_negative_control_waiting_for_the_last_gather_only_loses_the_others():
    out = run_distributed(_gather, 2, args=(True, 3), kwargs={"wait": _wait_last_only})
    assert out[0][:2] != _expected(3)[:2] and out[0][2] == _expected(3)[2]
