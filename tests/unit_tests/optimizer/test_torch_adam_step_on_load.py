# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""torch's Adam/AdamW (megatron-core's Adam without Transformer Engine or Apex) keeps a 'step' in
each param's state and creates it only for an empty state. Loading a checkpoint seeds the states
(init_state_fn: exp_avg, exp_avg_sq, no step) and FP32Optimizer/Float16Optimizer keep the shared
step only `if step:`, so a state of step 0 came back without one and the next step raised
KeyError: 'step'. The seeded state now has a step, and a step of 0 is saved."""

import pytest
import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

from megatron.core import dist_checkpointing
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.dist_checkpointing import TempNamedDir


def _model_and_optimizer():
    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=8,
    )
    if torch.cuda.is_available():
        model.cuda()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=False)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [model])
    return model, optimizer


def _train_step(model, optimizer):
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    tokens = torch.randint(0, 64, (2, 8), device=device)
    position_ids = torch.arange(8, device=device).expand(2, 8)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool, device=device).tril().logical_not()
    optimizer.zero_grad()
    model.zero_grad_buffer()
    model(tokens, position_ids, mask, labels=tokens).float().mean().backward()
    model.finish_grad_sync()
    return optimizer.step()


class TestTorchAdamStepOnLoad:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_a_checkpoint_of_step_0_loads_and_trains_on(self, tmp_path_dist_ckpt):
        model, optimizer = _model_and_optimizer()
        if not isinstance(optimizer.chained_optimizers[0].optimizer, torch.optim.Adam):
            pytest.skip(f"the defect is torch's Adam's; this run's is {type(optimizer)}")
        with TempNamedDir(tmp_path_dist_ckpt / "torch_adam_step_0", sync=True) as ckpt_dir:
            # the states a load seeds, saved before any step: a checkpoint of step 0
            state = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True)
            dist_checkpointing.save(state, ckpt_dir)
            model2, optimizer2 = _model_and_optimizer()
            to_load = optimizer2.sharded_state_dict(model2.sharded_state_dict(), is_loading=True)
            optimizer2.load_state_dict(dist_checkpointing.load(to_load, ckpt_dir))
        # before the fix: KeyError: 'step' in torch's Adam (the step of 0 not saved, none seeded)
        update_successful, grad_norm, _ = _train_step(model2, optimizer2)
        assert update_successful and grad_norm > 0
        inner = optimizer2.chained_optimizers[0].optimizer
        assert {float(s["step"]) for s in inner.state.values()} == {1.0}
