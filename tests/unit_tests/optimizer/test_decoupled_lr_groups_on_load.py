# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""A DistributedOptimizer resume with --decoupled-lr: the decoupled group (embedding, output
layer) and the default group share one identity (param_group_identifier_keys), and load_state_dict
mapped each identity to the last saved group of it: every group of the resumed optimizer got the
decoupled group's lr bounds. The k-th saved group of an identity now loads into the k-th one."""

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

LR, DECOUPLED_LR = 1e-2, 3e-3


def _optimizer():
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=8,
    )
    if torch.cuda.is_available():
        model.cuda()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=LR, decoupled_lr=DECOUPLED_LR, use_distributed_optimizer=True
    )
    return get_megatron_optimizer(opt_config, [model])


def _max_lrs(optimizer):
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [group["max_lr"] for opt in inner for group in opt.optimizer.param_groups]


class TestDecoupledLrGroupsOnLoad:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_each_group_keeps_its_lr_bounds_through_a_load(self):
        saved = _optimizer()
        before = _max_lrs(saved)
        assert LR in before and DECOUPLED_LR in before
        fresh = _optimizer()
        fresh.load_state_dict(saved.state_dict())
        # before the fix: every group DECOUPLED_LR (the last saved group of the identity)
        assert _max_lrs(fresh) == before
