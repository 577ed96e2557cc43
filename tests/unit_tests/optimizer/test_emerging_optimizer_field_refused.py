# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""An emerging optimizer (--optimizer lion, soap, ...) is built from the OptimizerConfig fields
named <optimizer>_<argument> that the installed class's __init__ takes; the others were dropped
without a word. OptimizerConfig.lion_beta1 ("First beta coefficient for Lion optimizer") is one:
Lion as --optimizer takes its betas from adam_beta1/2, so a lion_beta1 given had no effect. A
field set away from its default that the class does not take is now refused, naming it."""

import pytest
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

pytest.importorskip("emerging_optimizers")


def _model():
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
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


class TestEmergingOptimizerFieldRefused:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_a_lion_field_given_reaches_lion_or_is_refused(self):
        config = OptimizerConfig(optimizer="lion", lr=1e-3, lion_beta1=0.5)
        try:
            optimizer = get_megatron_optimizer(config, [_model()])
        except ValueError as error:
            assert "lion_beta1=0.5" in str(error)
            return
        betas = {g["betas"] for o in optimizer.chained_optimizers for g in o.optimizer.param_groups}
        # before the fix: built, betas {(0.9, 0.999)} (adam_beta1/2): lion_beta1 dropped
        assert all(beta1 == 0.5 for beta1, _ in betas), betas

    def test_fields_at_their_defaults_build_lion(self):
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="lion", lr=1e-3), [_model()])
        names = {type(o.optimizer).__name__ for o in optimizer.chained_optimizers}
        assert "Lion" in names
