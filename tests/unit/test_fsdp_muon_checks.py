"""What our Muon refuses under Megatron-FSDP (``fsdp.check_megatron_fsdp``, called by the factory on
every rank before the optimizer exists): each by the setting's name and what is allowed."""

import types

import pytest
from megatron.core.distributed import DistributedDataParallelConfig

from megatron.core.optimizer.megatron_muon.fsdp import SHARDED_STRATEGIES, check_megatron_fsdp


def _chunks(**ddp) -> list:
    ddp = dict(use_distributed_optimizer=True, use_megatron_fsdp=True, **ddp)
    return [types.SimpleNamespace(ddp_config=DistributedDataParallelConfig(**ddp))]


REFUSED = {
    "no_shard": (
        dict(data_parallel_sharding_strategy="no_shard"),
        ["data_parallel_sharding_strategy='no_shard'", "'optim_grads_params'"],
    ),
    "hybrid_fsdp_outer_optim": (
        dict(
            num_distributed_optimizer_instances=2,
            outer_dp_sharding_strategy="optim",
            overlap_grad_reduce=True,
        ),
        ["outer_dp_sharding_strategy='optim'", "--outer-dp-sharding-strategy", "'no_shard'"],
    ),
    "hsdp_without_overlap": (
        dict(num_distributed_optimizer_instances=2, overlap_grad_reduce=False),
        ["'optim'", "needs --overlap-grad-reduce", "each replica steps on its own"],
    ),
    "precision_aware": (
        dict(megatron_fsdp_use_decoupled_grad=True),
        ["--use-precision-aware-optimizer"],
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_by_name(case):
    ddp, words = REFUSED[case]
    with pytest.raises(ValueError) as error:
        check_megatron_fsdp(None, _chunks(**{"data_parallel_sharding_strategy": "optim", **ddp}))
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize("strategy", SHARDED_STRATEGIES)
def test_sharded_strategies_and_hsdp_are_accepted(strategy):
    check_megatron_fsdp(None, _chunks(data_parallel_sharding_strategy=strategy))
    hsdp = dict(num_distributed_optimizer_instances=2, overlap_grad_reduce=True)
    check_megatron_fsdp(None, _chunks(data_parallel_sharding_strategy=strategy, **hsdp))
