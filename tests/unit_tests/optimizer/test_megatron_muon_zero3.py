# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""muon_impl='megatron_muon' under torch FSDP2 (TorchFullyShardedDataParallel, ZeRO-3): the
factory finds the Muon params sharded as DTensors and orthogonalizes each matrix whole on one
owner, reached from the Shard(0) pieces by an exchange, so a step under FSDP2 equals the
unsharded step. Newton-Schulz of a rank's local piece would not (upstream PR #5961's warning)."""

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
)
from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
    TorchFullyShardedDataParallelConfig,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils
from torch.distributed.tensor import DTensor

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.megatron_muon.fsdp import Zero3Orthogonalizer
from tests.unit_tests.optimizer import test_megatron_muon_distributed_optimizer as distopt_test

# fp32: the exchange moves each matrix's pieces as they are and Newton-Schulz runs on the same
# whole matrix; only the DP reduction orders differ (FSDP2 reduce-scatters, DDP all-reduces)
RTOL = 1e-5


def _model_and_optimizer(weights, fsdp2):
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        transformer_impl="local",
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
        share_embeddings_and_output_weights=False,  # FSDP2 requires it
    )
    if weights is not None:  # the reference's initial weights
        for name, param in model.named_parameters():
            param.data.copy_(weights[name])
    if torch.cuda.is_available():
        model.cuda()
    if fsdp2:
        model = TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(), model)
    else:
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(optimizer="muon", muon_impl="megatron_muon", lr=1e-2)
    return model, get_megatron_optimizer(opt_config, [model])


def _step(model, optimizer):
    """The distributed optimizer test's step (this PR carries it); params whole, not sharded."""
    params = distopt_test._step(model, optimizer)
    return {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in params.items()}


def _muon(optimizer):
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [getattr(o, "optimizer", o) for o in inner]


class TestMegatronMuonZero3:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_fsdp2_step_equals_the_unsharded_step(self):
        reference, ref_optimizer = _model_and_optimizer(None, fsdp2=False)
        weights = {n: p.detach().clone() for n, p in reference.module.named_parameters()}
        model, optimizer = _model_and_optimizer(weights, fsdp2=True)
        if torch.distributed.get_world_size() > 1:  # sharded: the exchange is attached
            orthogonalizers = [getattr(o, "orthogonalizer", None) for o in _muon(optimizer)]
            assert any(isinstance(o, Zero3Orthogonalizer) for o in orthogonalizers)
        expected, got = _step(reference, ref_optimizer), _step(model, optimizer)
        moved = [n for n in expected if not torch.equal(expected[n], weights[n])]
        assert len(moved) == len(expected)  # every param stepped
        errors = {
            n: ((got[n] - e).norm() / (e - weights[n]).norm()).item() for n, e in expected.items()
        }
        # error relative to the update: the step itself, not the weights, is compared
        assert not {n: e for n, e in errors.items() if not e < RTOL}
