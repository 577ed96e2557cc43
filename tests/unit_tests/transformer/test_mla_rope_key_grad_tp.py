# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""Multi-latent attention with a column-parallel linear_kv_down_proj (the local spec's) at TP 2:
its output is gathered over TP, whose backward keeps each rank's slice of the grad. The shared
rope key k_pos_emb is used by each rank's own heads only, so its grad was one rank's heads' part
and the grads of linear_kv_down_proj and of everything before it missed (Megatron-LM issue
1699). Here every grad after finalize_model_grads at TP 2 equals TP 1's, same weights, same
batch."""

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
from megatron.core.transformer import MLATransformerConfig
from tests.unit_tests.test_utilities import Utils

MLA = dict(q_lora_rank=None, kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
# fp32 throughout: TP only reorders fp32 sums; an unsummed rope-key grad misses by ~5e-2
RTOL = 1e-5


def _model(tp, weights=None):
    config = MLATransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        multi_latent_attention=True,
        rope_type="rope",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        **MLA,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(multi_latent_attention=True),
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


class TestMLARopeKeyGradOverTP:
    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_tp2_grads_equal_tp1(self):
        if Utils.world_size < 2:
            pytest.skip("needs 2 ranks")
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)
        reference = _model(1)
        weights = {n: p.detach().clone() for n, p in reference.module.named_parameters()}
        expected = _grads(reference, 1)
        Utils.destroy_model_parallel()
        Utils.initialize_model_parallel(2, 1)
        model_parallel_cuda_manual_seed(123)
        got = _grads(_model(2, weights), 2)
        assert got.keys() == expected.keys()
        errors = {
            n: ((got[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in expected.items()
        }
        # before the fix: linear_kv_down_proj.weight's and the grads before it miss
        assert not {n: e for n, e in errors.items() if not e < RTOL}
