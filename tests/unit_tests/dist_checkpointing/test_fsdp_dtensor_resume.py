# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""--use-megatron-fsdp with --ckpt-format fsdp_dtensor: save, then load into a fresh model and
optimizer. Two defects of 0.19.2: (1) a rank whose shard of a parameter is empty has no
optimizer state for it, and the save's preprocessing runs one collective per DTensor of the
sorted state dict, so ranks named different DTensors and the save hung; (2) the load asks DCP
for the keys of a state dict it generates, which has 'iteration' but not
'num_floating_point_operations_so_far', so a resumed run counted its FLOPs from 0."""

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.global_vars import set_args

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.unit_tests.dist_checkpointing import TempNamedDir
from tests.unit_tests.dist_checkpointing.test_torch_dcp_chained_optimizer_load import (
    ResumeTestSetup,
    Scheduler,
    checkpoint_args,
    step,
    tiny_gpt,
)

FLOPS = 123456789.0  # num_floating_point_operations_so_far at the save


def _model_and_optimizer():
    config, model = tiny_gpt()
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,  # --use-megatron-fsdp sets it
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
    )
    model = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True)
    return model, get_megatron_optimizer(config, [model])


def _local(model):
    return {
        name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def _args(folder):
    args = checkpoint_args(folder, "fsdp_dtensor")
    args.use_megatron_fsdp = args.use_distributed_optimizer = True
    args.data_parallel_sharding_strategy = "optim_grads_params"
    return args


class TestFsdpDtensorResume(ResumeTestSetup):
    def test_fsdp_dtensor_save_and_resume(self, tmp_path_dist_ckpt):
        with TempNamedDir(tmp_path_dist_ckpt / "fsdp_dtensor_resume", sync=True) as folder:
            set_args(_args(folder))
            model, optimizer = _model_and_optimizer()
            step(model, optimizer)
            save_checkpoint(5, [model], optimizer, Scheduler(5), FLOPS)  # before: hangs
            saved = _local(model)

            fresh, fresh_optimizer = _model_and_optimizer()
            scheduler = Scheduler(0)
            iteration, flops = load_checkpoint([fresh], fresh_optimizer, scheduler)
            assert iteration == 5 and scheduler.steps == 5
            assert flops == FLOPS  # before the fix: 0
            loaded = _local(fresh)
            assert loaded.keys() == saved.keys()
            for name, value in saved.items():
                assert torch.equal(loaded[name], value), name
