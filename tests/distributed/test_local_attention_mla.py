"""The local DotProductAttention with multi-latent attention's head dims (patch 0018): query/key
heads of ``k_channels`` and value heads of ``v_channels``, as MLASelfAttention builds it, give
softmax(q k^T s + causal mask) v computed directly; without the head dims (upstream's local
attention, sized by ``kv_channels``) the same inputs do not fit.

    .venv/bin/python -m pytest tests/distributed/test_local_attention_mla.py -q
"""

import pytest
import torch
from harness import RankFailure, run_distributed

HEADS, K, V, SEQ, BATCH = 4, 12, 8, 6, 2
KV_CHANNELS = 16  # the config's head dim, which MLA's differ from


def _attention(k_channels, v_channels, scale):
    """(local attention's output, the direct formula's) on one rank, in fp32, no dropout."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=HEADS,
        kv_channels=KV_CHANNELS,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
    )
    attn = DotProductAttention(
        config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        softmax_scale=scale,
        k_channels=k_channels,
        v_channels=v_channels,
    )
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(SEQ, BATCH, HEADS, K, generator=gen) for _ in range(2))
    v = torch.randn(SEQ, BATCH, HEADS, V, generator=gen)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)  # True: masked out
    got = attn(q, k, v, mask)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * (K**-0.5 if scale is None else scale)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    want = torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(SEQ, BATCH, HEADS * V)
    return got, want


# None: the default scale, 1/sqrt(k_channels); 0.3: MLA's own (it passes softmax_scale)
@pytest.mark.parametrize("scale", [None, 0.3])
def test_mla_head_dims_match_the_direct_formula(scale):
    # fp32 on one process: a softmax and two matmuls of <= 12 terms; the two computations may
    # differ in summation order only (measured: bit-equal under the default and avx2 kernels;
    # 1e-6 is ~10 ulps of the outputs, of size <= 2.8, and far below a wrong scale's change)
    got, want = run_distributed(_attention, 1, args=(K, V, scale))[0]
    assert got.shape == (SEQ, BATCH, HEADS * V)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_without_the_head_dims_the_output_is_sized_by_kv_channels():
    """Negative control: upstream's sizing (kv_channels for both) cannot reshape MLA's output."""
    sized = rf"shape '\[{SEQ}, {BATCH}, {KV_CHANNELS * HEADS}\]' is invalid"
    with pytest.raises(RankFailure, match=sized):
        run_distributed(_attention, 1, args=(None, None, None))
