# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""Multi-latent attention with a column-parallel linear_kv_down_proj (the local spec's) at TP 2:
its output is gathered over TP, whose backward keeps each rank's slice of the grad. The shared
rope key k_pos_emb is used by each rank's own heads only, so its grad was one rank's heads' part
and the grads of linear_kv_down_proj and of everything before it missed (Megatron-LM issue
1699). Here every grad after finalize_model_grads at TP 2 equals TP 1's, same weights, same
batch."""

import pytest
from tests.unit_tests.test_utilities import Utils

from tests.unit_tests.transformer.test_local_attention_mla import tp1_and_tp2_grads

MLA = dict(q_lora_rank=None, kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16)
# fp32 throughout: TP only reorders fp32 sums; an unsummed rope-key grad misses by ~5e-2
RTOL = 1e-5


class TestMLARopeKeyGradOverTP:
    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_tp2_grads_equal_tp1(self):
        if Utils.world_size < 2:
            pytest.skip("needs 2 ranks")
        expected, got = tp1_and_tp2_grads(MLA, qk_layernorm=False)
        assert got.keys() == expected.keys()
        errors = {
            n: ((got[n] - g).norm() / g.norm().clamp_min(1e-12)).item() for n, g in expected.items()
        }
        # before the fix: linear_kv_down_proj.weight's and the grads before it miss
        assert not {n: e for n, e in errors.items() if not e < RTOL}
