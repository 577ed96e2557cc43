# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""QK-clip (MuonClip) with the local core attention: upstream records the per-head max attention
logits in Transformer Engine >= 2.9 only, so qk_clip needed TE. The local DotProductAttention
now records them, and clip_qk scales each head's query/key rows by upstream's rule
(eta = min(threshold / max, 1), split alpha / 1 - alpha), so the same batch's logits come back
at most the threshold: a head whose max was above it ends at it, the others keep theirs."""

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

from megatron.core.optimizer.qk_clip import clip_qk


def _max_logits(model, batch):
    """Each layer's per-head max logit of one forward of ``batch`` (what clip_qk reads)."""
    model(*batch)
    return [
        layer.self_attention.core_attention.current_max_attn_logits.clone()
        for layer in model.decoder.layers
    ]


class TestLocalAttentionQKClip:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_clip_bounds_the_logits_of_the_next_forward(self):
        config = TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            add_bias_linear=False,
            add_qkv_bias=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            qk_clip=True,
            qk_clip_alpha=0.5,
        )
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=64,
            max_sequence_length=16,
        )
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        model.to(device).train()
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        tokens = tokens.to(device)
        position_ids = torch.arange(16, device=device).expand(2, 16)
        mask = torch.ones(2, 1, 16, 16, dtype=torch.bool, device=device).tril().logical_not()
        batch = (tokens, position_ids, mask)
        # before the fix: None, the local attention recorded nothing
        before = _max_logits(model, batch)
        threshold = torch.cat(before).median().item()  # some heads above it, some not
        config.qk_clip_threshold = threshold
        assert clip_qk([model]) == max(m.max().item() for m in before)
        after = _max_logits(model, batch)
        for got, was in zip(after, before):
            expected = torch.minimum(was, torch.tensor(threshold, device=was.device))
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)
