# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""fp16 with expert parallelism: the dense and the expert optimizer of a ChainedOptimizer each
have a grad scaler, and the loss is scaled by the first one's. Each updated its own scaler with
its own inf/NaN check, so an inf in the expert grads alone backed off the expert scaler only:
the scales parted, and later expert grads were unscaled by a factor the loss was not scaled
by. Every scaler now takes the chain's verdict."""

import pytest
import torch
from megatron.core.optimizer.grad_scaler import DynamicGradScaler
from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params
from tests.unit_tests.test_utilities import Utils

from megatron.core.optimizer import OptimizerConfig

SCALE = 1024.0


def _optimizer(device):
    layer = torch.nn.Linear(4, 4, bias=False).half().to(device)
    scaler = DynamicGradScaler(
        initial_scale=SCALE,
        min_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=2,
        hysteresis=1,
    )
    config = OptimizerConfig(optimizer="adam", lr=1e-3, fp16=True)
    adam = torch.optim.Adam(layer.parameters(), lr=1e-3)
    return layer, Float16OptimizerWithFloat16Params(adam, config, scaler, lambda *_: None)


class TestChainedOptimizerLossScale:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("inf_in", ["expert", "dense", "none"])
    def test_every_scaler_takes_the_chains_verdict(self, inf_in):
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        (dense, dense_opt), (expert, expert_opt) = _optimizer(device), _optimizer(device)
        chain = ChainedOptimizer([dense_opt, expert_opt])
        for name, layer in (("dense", dense), ("expert", expert)):
            grad = torch.ones_like(layer.weight)
            if name == inf_in:
                grad[0, 0] = float("inf")
            layer.weight.grad = grad
        found_inf = chain.prepare_grads()
        assert found_inf is (inf_in != "none")
        scales = [opt.grad_scaler.scale.item() for opt in (dense_opt, expert_opt)]
        # before the fix, an expert-only inf: [1024.0, 512.0] (the dense scale kept)
        assert scales == [SCALE / 2 if found_inf else SCALE] * 2
        trackers = [opt.grad_scaler._growth_tracker for opt in (dense_opt, expert_opt)]
        assert trackers[0] == trackers[1]
