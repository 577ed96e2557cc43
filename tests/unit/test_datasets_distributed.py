"""The data path on 4 gloo ranks (TP=2 x DP=2), as pretrain_gpt.py drives it: only TP rank 0
builds datasets (rank 0 first, the builder's barrier), get_batch hands TP rank 0's batch to TP
rank 1, and each DP rank reads its slice of the global batch, equal to a single process."""

import pytest
import torch
from harness import run_distributed
from test_datasets import SEQ, build, write_tagged

from megatron.training import datasets as D

MBS = 2


def _rank_batches(data_path: str, cache: str, steps: int, consumed: int):
    from megatron.core import parallel_state as ps

    train, _, _ = build(data_path, [64, 16, 16], data_cache_path=cache)
    built = train is not None
    loader = D.build_pretraining_data_loader(train, consumed, MBS)
    it = iter(loader) if loader is not None else None
    tokens = [D.get_batch(it, MBS, SEQ)[0] for _ in range(steps)]
    return built, ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), tokens


@pytest.mark.distributed
@pytest.mark.parametrize("consumed", [0, 8])
def test_tp_broadcast_and_dp_slices_match_one_process(tmp_path, consumed):
    prefix = write_tagged(str(tmp_path / "docs"), 200)
    # The single-process reference builds the same index cache first; the ranks then must
    # read identical samples from it.
    train, _, _ = build(prefix, [64, 16, 16], data_cache_path=str(tmp_path / "ref"))
    out = run_distributed(
        _rank_batches, 4, tp=2, args=(prefix, str(tmp_path / "cache"), 3, consumed), timeout=120
    )
    for built, tp_rank, dp_rank, tokens in out:
        assert built == (tp_rank == 0)
        for step, batch in enumerate(tokens):
            # Global batch = MBS x DP = 4 consecutive samples; DP rank r reads its 2.
            first = consumed + step * 2 * MBS + dp_rank * MBS
            expected = torch.stack([train[i]["tokens"] for i in range(first, first + MBS)])
            assert torch.equal(batch, expected)
