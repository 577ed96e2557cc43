# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""--optimizer adaptive_muon on emerging-optimizers 0.3.0 (the package index's; 0.19 was written
against 0.2.0): 0.3.0's AdaptiveMuon.step scales each update by self.scale_mode and
self.extra_scale_factor, which TensorParallelAdaptiveMuon never set (its __init__ calls
TensorParallelMuon's, not AdaptiveMuon's), so the first step raised AttributeError
'scale_mode'. Megatron-LM main sets them since it moved to 0.3.0 (2c8ac9b753)."""

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


class TestAdaptiveMuonSteps:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_adaptive_muon_steps_every_matrix(self):
        model = _model()
        config = OptimizerConfig(optimizer="adaptive_muon", lr=1e-2, bf16=False)
        optimizer = get_megatron_optimizer(config, [model])
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        for param in model.parameters():
            param.main_grad = torch.ones_like(param)  # what DDP's buffers hand the optimizer
        optimizer.step()  # before the fix: AttributeError 'scale_mode'
        muon = [o.optimizer for o in optimizer.chained_optimizers]
        muon = [o for o in muon if type(o).__name__ == "TensorParallelAdaptiveMuon"]
        assert len(muon) == 1 and muon[0].scale_mode == config.muon_scale_mode
        matrices = {id(p) for group in muon[0].param_groups for p in group["params"]}
        moved = [
            name
            for name, p in model.named_parameters()
            if id(p) in matrices and not torch.equal(p, before[name])
        ]
        assert len(moved) == len(matrices) > 0  # every matrix Muon holds took a step
