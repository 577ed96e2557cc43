# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""The local spec's torch norms (WrappedTorchNorm) with sequence parallelism and a
zero-centered gamma (apply_layernorm_1p): both were asserted off, so MoE at TP > 1 (which needs
sequence parallelism) could not run without Transformer Engine or Apex. Their params are now
marked sequence_parallel, as TE's and Apex's are, so finalize_model_grads sums their grads over
TP. Here every grad after finalize_model_grads at TP 2 with sequence parallelism equals TP 1's,
same weights, same batch."""

import pytest
import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

# fp32 throughout: TP and SP only reorder fp32 sums
RTOL = 1e-5


def _model(tp, normalization, weights=None):
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        normalization=normalization,
        layernorm_zero_centered_gamma=True,
        sequence_parallel=tp > 1,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization=normalization),
        vocab_size=128,
        max_sequence_length=16,
        position_embedding_type="rope",
    )
    if weights is not None:  # TP 1's whole weights, this rank's slice of each
        rank = torch.distributed.get_rank() % tp
        for name, param in model.named_parameters():
            whole = weights[name]
            if getattr(param, "tensor_model_parallel", False):
                whole = whole.chunk(tp, dim=param.partition_dim)[rank]
            param.data.copy_(whole)
    if torch.cuda.is_available():
        model.cuda()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def _grads(model, tp):
    """Every grad after finalize_model_grads, whole (TP shards gathered), by name."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (2, 16), generator=generator).to(device)
    position_ids = torch.arange(16, device=device).expand(2, 16)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool, device=device).tril().logical_not()
    model.zero_grad_buffer()
    model(tokens, position_ids, mask, labels=tokens).float().mean().backward()
    finalize_model_grads([model])
    grads = {}
    for name, param in model.module.named_parameters():
        grad = param.main_grad.detach().clone()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(grad) for _ in range(tp)]
            torch.distributed.all_gather(parts, grad)
            grad = torch.cat(parts, dim=param.partition_dim)
        grads[name] = grad
    return grads


class TestLocalNormsSequenceParallel:
    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
    def test_tp2_sp_grads_equal_tp1(self, normalization):
        if Utils.world_size < 2:
            pytest.skip("needs 2 ranks")
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)
        reference = _model(1, normalization)
        weights = {n: p.detach().clone() for n, p in reference.module.named_parameters()}
        expected = _grads(reference, 1)
        Utils.destroy_model_parallel()
        Utils.initialize_model_parallel(2, 1)
        model_parallel_cuda_manual_seed(123)
        model = _model(2, normalization, weights)
        got = _grads(model, 2)
        assert got.keys() == expected.keys()
        # the norms' params marked as TE's and Apex's are (finalize_model_grads sums them)
        norms = [p for n, p in model.module.named_parameters() if "layernorm" in n]
        assert norms and all(getattr(p, "sequence_parallel", False) for p in norms)
        errors = {
            n: ((got[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in expected.items()
        }
        assert not {n: e for n, e in errors.items() if not e < RTOL}
