"""Our Muon's DDP layout (``megatron_muon/layout.py``) and the holder placement that goes with it
(``placement.holder_owners``): pure arithmetic on shapes, no process group.

    .venv/bin/python -m pytest tests/unit/test_muon_layout.py -q
"""

import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

from megatron.core.optimizer.megatron_muon.distrib_optimizer import MuonDistributedOptimizer
from megatron.core.optimizer.megatron_muon.layout import TAG, holder_costs
from megatron.core.optimizer.megatron_muon.planner.placement import HOLDER_SLACK, holder_owners

# (costs, holders, world, min_efficiency, owners expected; None: whole matrices cannot balance)
HOLDER_CASES = [
    ([4, 4, 4, 4], [0, 1, 0, 1], 2, 0.0, [0, 1, 0, 1]),  # balanced: every holder owns
    ([3, 3, 1, 1], [0, 0, 0, 1], 2, 0.0, [1, 0, 0, 1]),  # loads 7/1: one move of 3 evens them
    ([5, 1], [0, 1], 2, 0.0, None),  # loads 5/1: moving the 5 only swaps the busiest
    ([1 + HOLDER_SLACK / 2, 1], [0, 1], 2, 0.0, [0, 1]),  # within the slack: kept
    ([1 + HOLDER_SLACK / 2, 1], [0, 1], 2, 0.999, None),  # ... but under an efficiency floor
    ([], [], 4, 0.0, []),  # no matrices
]


@pytest.mark.parametrize("costs,holders,world,floor,expected", HOLDER_CASES)
def test_holder_owners(costs, holders, world, floor, expected):
    assert holder_owners(costs, holders, world, floor) == expected


# (costs, holders, world, cells: TP ranks per owner in the ``owner`` TP mode, owners expected)
CELL_CASES = [
    # rank 0's three 3s over its two TP ranks: one has 6. A 3 moves to rank 1 and two 1s come
    # back: the busiest TP rank of the grid goes from 6 to 5.
    ([3, 3, 3] + [1] * 9, [0, 0, 0] + [1] * 9, 2, 2, [0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 1, 1]),
    ([3, 3, 1, 1], [0, 0, 0, 1], 2, 2, [0, 0, 1, 1]),  # whole-rank balance would move a 3
    ([4, 4, 4, 4], [0, 0, 1, 1], 2, 2, None),  # one matrix per TP rank already: no move
    ([6, 1, 1, 1, 1], [0, 0, 1, 1, 1], 2, 2, None),  # the 6 bounds every placement
    ([], [], 2, 2, []),
]


@pytest.mark.parametrize("costs,holders,world,cells,expected", CELL_CASES)
def test_holder_owners_balance_the_tp_ranks_of_the_owner_mode(
    costs, holders, world, cells, expected
):
    assert holder_owners(costs, holders, world, 0.0, cells) == expected


def _params(shapes):
    return [torch.nn.Parameter(torch.empty(shape)) for shape in shapes]


DDP = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
LAYER = [(96, 64), (64, 64), (192, 64), (64, 96), (64,)]  # qkv, proj, fc1, fc2, a norm


def _layout(shapes, dp):
    params = _params(shapes)
    layout = MuonDistributedOptimizer.compute_full_param_layout(params, None, dp, DDP)
    return params, layout


def test_balanced_layers_get_the_shard_aligned_layout():
    """Four equal layers over 4 ranks: each matrix whole in one shard, the loads even; the 1-D
    param stays in DistOpt's byte-level buffer."""
    params, layout = _layout(LAYER * 4, 4)
    managed = [k for k in layout.layouts if k.is_managed_by_layer_wise_optimizer]
    assert len(managed) == 1 and len(layout.layouts) == 2
    costs, holders = holder_costs(layout.layouts[managed[0]], 4)
    assert holder_owners(costs, holders, 4) == holders  # balanced as laid out: no move
    assert [getattr(p, TAG, False) for p in params] == [p.dim() == 2 for p in params]


@pytest.mark.parametrize(
    "shapes,dp",
    [(LAYER, 3), (LAYER * 4, 1), (LAYER, 8)],  # 4 matrices over 3 or 8 ranks; one rank
)
def test_unbalanced_or_single_rank_keeps_the_byte_level_layout(shapes, dp):
    params, layout = _layout(shapes, dp)
    assert not any(hasattr(p, TAG) for p in params)  # untagged: DDP groups them as upstream
    expected = DistributedOptimizer.compute_full_param_layout(params, None, dp, DDP)
    assert layout.layouts.keys() == expected.layouts.keys()
    for key, per in layout.layouts.items():
        assert per.param_index_map == expected.layouts[key].param_index_map


@pytest.mark.parametrize("dp,aligned", [(4, False), (2, True)])
def test_padding_is_weighed_against_the_exchange_it_spares(dp, aligned):
    """Twenty 64 x 64 matrices in buckets of five: shard-aligned, the holders balance at DP 4 and
    2. At DP 4 a bucket's five whole matrices fill four shards of two, so the padding (12
    matrices in all) outweighs the ``M / dp`` = 5 matrices a rank's exchange would move: the
    layout stays DistOpt's byte-level one. At DP 2 (shards of three: 6 padded against 10) it
    stays shard-aligned."""
    shapes, bucket = [(64, 64)] * 20, 5 * 64 * 64
    lw = LayerWiseDistributedOptimizer.compute_full_param_layout(_tagged(shapes), bucket, dp, DDP)
    (per,) = lw.layouts.values()
    assert holder_owners(*holder_costs(per, dp), dp) is not None  # balanced either way
    padded = per.bucket_indices[-1][1] - 20 * 64 * 64
    assert (padded * dp > 20 * 64 * 64) == (not aligned)  # the padding against M / dp
    params = _params(shapes)
    layout = MuonDistributedOptimizer.compute_full_param_layout(params, bucket, dp, DDP)
    assert all(hasattr(p, TAG) for p in params) == aligned
    expected = (lw if aligned else DistributedOptimizer.compute_full_param_layout(
        _params(shapes), bucket, dp, DDP))  # fmt: skip
    assert [per.bucket_indices for per in layout.layouts.values()] == [
        per.bucket_indices for per in expected.layouts.values()
    ]


def _tagged(shapes):
    params = _params(shapes)
    for p in params:
        setattr(p, TAG, True)
    return params
