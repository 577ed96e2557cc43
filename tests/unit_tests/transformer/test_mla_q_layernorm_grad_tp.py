# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""Multi-latent attention with qk_layernorm at TP 2 (the local spec): finalize_model_grads sums
over TP the grads of params named q_layernorm / k_layernorm, per-head norms whose grads each rank
holds a part of. MLA's q_layernorm normalizes the whole q latent; without sequence parallelism
its grad is already whole on every rank, and was multiplied by TP. Here the norms' grads after
finalize_model_grads at TP 2 equal TP 1's, same weights, same batch."""

import pytest
from tests.unit_tests.test_utilities import Utils

from tests.unit_tests.transformer.test_local_attention_mla import tp1_and_tp2_grads

MLA = dict(q_lora_rank=32, kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
# fp32 throughout: TP only reorders fp32 sums; a grad summed twice misses by 1.0 (2x)
RTOL = 1e-5


class TestMLAQLayernormGradOnce:
    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_tp2_norm_grads_equal_tp1(self):
        if Utils.world_size < 2:
            pytest.skip("needs 2 ranks")
        expected, got = tp1_and_tp2_grads(MLA, qk_layernorm=True)
        norms = [n for n in expected if "q_layernorm" in n or "kv_layernorm" in n]  # not 0019's
        assert any("q_layernorm" in name for name in norms)
        errors = {n: ((got[n] - expected[n]).norm() / expected[n].norm()).item() for n in norms}
        # before the fix: q_layernorm.weight's error 1.0 (twice TP 1's grad)
        assert not {n: e for n, e in errors.items() if not e < RTOL}
