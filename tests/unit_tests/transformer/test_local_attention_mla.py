# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""Multi-latent attention on the local spec: MLASelfAttention builds its core attention with
k_channels (the query/key head dim, qk_head_dim + qk_pos_emb_head_dim) and v_channels (the value
head dim); the local DotProductAttention took neither, so MLA needed Transformer Engine. It now
sizes its output by v_channels and its default softmax scale by k_channels."""

import math

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
from megatron.core.transformer.dot_product_attention import DotProductAttention
from tests.unit_tests.test_utilities import Utils

QK, POS, V, HEADS = 16, 8, 12, 4


def _mla_model(tp, mla, qk_layernorm, weights=None):
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
        qk_layernorm=qk_layernorm,
        tensor_model_parallel_size=tp,
        **mla,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            multi_latent_attention=True, qk_layernorm=qk_layernorm
        ),
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


def tp1_and_tp2_grads(mla, qk_layernorm=False):
    """(TP 1's grads, TP 2's) after finalize_model_grads: an MLA GPT on the local spec, the same
    weights (TP 2 takes TP 1's, sliced) and the same batch; for the MLA fixes' tests."""
    Utils.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(123)
    reference = _mla_model(1, mla, qk_layernorm)
    weights = {n: p.detach().clone() for n, p in reference.module.named_parameters()}
    expected = _grads(reference, 1)
    Utils.destroy_model_parallel()
    Utils.initialize_model_parallel(2, 1)
    model_parallel_cuda_manual_seed(123)
    return expected, _grads(_mla_model(2, mla, qk_layernorm, weights), 2)


class TestLocalAttentionMLA:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_mla_trains_on_the_local_core_attention(self):
        config = MLATransformerConfig(
            num_layers=1,
            hidden_size=32,
            num_attention_heads=HEADS,
            multi_latent_attention=True,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_head_dim=QK,
            qk_pos_emb_head_dim=POS,
            v_head_dim=V,
            rope_type="rope",
            use_cpu_initialization=True,
        )
        # before the fix: TypeError, DotProductAttention takes no k_channels
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(multi_latent_attention=True),
            vocab_size=64,
            max_sequence_length=8,
            position_embedding_type="rope",
        )
        core = model.decoder.layers[0].self_attention.core_attention
        assert isinstance(core, DotProductAttention)
        assert core.hidden_size_per_partition == HEADS * V
        assert math.isclose(core.softmax_scale, 1 / math.sqrt(QK + POS), rel_tol=1e-6)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        model.to(device)
        tokens = torch.randint(0, 64, (2, 8), device=device)
        position_ids = torch.arange(8, device=device).expand(2, 8)
        mask = torch.ones(2, 1, 8, 8, dtype=torch.bool, device=device).tril().logical_not()
        model(tokens, position_ids, mask, labels=tokens).float().mean().backward()
        proj = model.decoder.layers[0].self_attention.linear_proj.weight
        assert proj.shape[1] == HEADS * V and proj.grad.abs().sum() > 0
