# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""--use-megatron-fsdp with --ckpt-format fsdp_dtensor: save, then load into a fresh model and
optimizer. Two defects of 0.19.2: (1) a rank whose shard of a parameter is empty has no
optimizer state for it, and the save's preprocessing runs one collective per DTensor of the
sorted state dict, so ranks named different DTensors and the save hung; (2) the load asks DCP
for the keys of a state dict it generates, which has 'iteration' but not
'num_floating_point_operations_so_far', so a resumed run counted its FLOPs from 0."""

import sys
from unittest import mock

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.num_microbatches_calculator import (
    init_num_microbatches_calculator,
    unset_num_microbatches_calculator,
)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.global_vars import set_args
from tests.unit_tests.test_utilities import Utils

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.training import arguments
from tests.unit_tests.dist_checkpointing import TempNamedDir

FLOPS = 123456789.0  # num_floating_point_operations_so_far at the save


def _model_and_optimizer():
    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        transformer_impl="local",
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=32,
        max_sequence_length=8,
    )
    if torch.cuda.is_available():
        model.cuda()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,  # --use-megatron-fsdp sets it
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
    )
    model = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True)
    return model, get_megatron_optimizer(config, [model])


def _step(model, optimizer):
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    position_ids = torch.arange(8, device=device).expand(2, 8)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool, device=device).tril().logical_not()
    optimizer.zero_grad()
    model.zero_grad_buffer()
    model(tokens, position_ids, mask, labels=tokens).float().mean().backward()
    model.finish_grad_sync()
    assert optimizer.step()[0]


def _local(model):
    return {
        name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for name, p in model.named_parameters()
    }


class _Scheduler:
    """The learning-rate scheduler's checkpoint interface."""

    def __init__(self, steps):
        self.steps = steps

    def state_dict(self):
        return {"num_steps": self.steps}

    def load_state_dict(self, state_dict):
        self.steps = state_dict["num_steps"]


def _args(folder):
    with mock.patch.object(sys, "argv", ["test"]):
        args = arguments.parse_args(ignore_unknown_args=True)
    args.save = args.load = str(folder)
    args.ckpt_format, args.use_dist_ckpt = "fsdp_dtensor", True  # as validate_args sets them
    args.use_megatron_fsdp = args.use_distributed_optimizer = True
    args.data_parallel_sharding_strategy = "optim_grads_params"
    args.save_interval = 1
    args.exit_on_missing_checkpoint = True
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.world_size = torch.distributed.get_world_size()
    args.data_parallel_size = args.world_size
    return args


class TestFsdpDtensorResume:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)
        init_num_microbatches_calculator(0, None, 1, 1, 1)

    def teardown_method(self, method):
        unset_num_microbatches_calculator()
        Utils.destroy_model_parallel()

    def test_fsdp_dtensor_save_and_resume(self, tmp_path_dist_ckpt):
        with TempNamedDir(tmp_path_dist_ckpt / "fsdp_dtensor_resume", sync=True) as folder:
            set_args(_args(folder))
            model, optimizer = _model_and_optimizer()
            _step(model, optimizer)
            save_checkpoint(5, [model], optimizer, _Scheduler(5), FLOPS)  # before: hangs
            saved = _local(model)

            fresh, fresh_optimizer = _model_and_optimizer()
            scheduler = _Scheduler(0)
            iteration, flops = load_checkpoint([fresh], fresh_optimizer, scheduler)
            assert iteration == 5 and scheduler.steps == 5
            assert flops == FLOPS  # before the fix: 0
            loaded = _local(fresh)
            assert loaded.keys() == saved.keys()
            for name, value in saved.items():
                assert torch.equal(loaded[name], value), name
