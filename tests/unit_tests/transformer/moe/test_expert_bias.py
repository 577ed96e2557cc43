# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""Experts with biases (add_bias_linear) at TP=1 without expert parallelism: MLP.forward added
the routing-weighted bias in place to the row-parallel output, which at TP=1 is its input
returned as is (a view autograd forbids modifying in place): the first forward raised."""

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import get_submodules
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils


class TestSequentialMLPExpertBias:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_expert_bias_forward_and_backward_at_tp1(self):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=12,
            num_attention_heads=4,
            num_moe_experts=2,
            moe_router_topk=2,
            use_cpu_initialization=True,
            add_bias_linear=True,
            moe_token_dispatcher_type="alltoall",
        )
        submodules = get_submodules(
            get_gpt_layer_local_submodules(num_experts=2, moe_grouped_gemm=False).mlp
        )
        layer = MoELayer(config, submodules)
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        layer.to(device)
        hidden = torch.randn(8, 2, 12, device=device, requires_grad=True)
        output, bias = layer(hidden)  # before the fix: RuntimeError (in-place on a view)
        output.sum().backward()
        assert output.shape == hidden.shape
        assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0
        expert_biases = [p for n, p in layer.named_parameters() if "experts" in n and "bias" in n]
        assert expert_biases and all(p.grad is not None for p in expert_biases)
