# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""Multi-latent attention on the local spec: MLASelfAttention builds its core attention with
k_channels (the query/key head dim, qk_head_dim + qk_pos_emb_head_dim) and v_channels (the value
head dim); the local DotProductAttention took neither, so MLA needed Transformer Engine. It now
sizes its output by v_channels and its default softmax scale by k_channels."""

import math

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import MLATransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from tests.unit_tests.test_utilities import Utils

QK, POS, V, HEADS = 16, 8, 12, 4


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
