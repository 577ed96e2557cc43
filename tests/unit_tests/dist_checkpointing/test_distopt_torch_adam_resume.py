# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""A DistributedOptimizer checkpoint of torch's Adam (megatron-core's Adam without Transformer
Engine or Apex) resumes exactly in 0.19: a fresh optimizer's state dict asserted (no 'step' yet),
loading copied a per-param step, every param shared one step tensor after load_state_dict, and
fully_reshardable saved shifted state with several buckets. Fixed on main by
NVIDIA/Megatron-LM#5077. Here: train, save (torch_dist, each DistOpt format), train on; a fresh
model and optimizer load it and train the same steps: every param equal, bit for bit."""

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
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
    )
    if torch.cuda.is_available():
        model.cuda()
    # small buckets: params straddle DP shards and buckets end in padding
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=4000)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True)
    return model, get_megatron_optimizer(opt_config, [model])


def _step(model, optimizer, seed):
    device = next(model.parameters()).device
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
    tokens = tokens.to(device)
    position_ids = torch.arange(16, device=device).expand(2, 16)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool, device=device).tril().logical_not()
    optimizer.zero_grad()
    model.zero_grad_buffer()
    model(tokens, position_ids, mask, labels=tokens).float().mean().backward()
    model.finish_grad_sync()
    assert optimizer.step()[0]


def _sharded(model, optimizer, fmt, is_loading):
    model_sd = model.module.sharded_state_dict()
    metadata = {"distrib_optim_sharding_type": fmt, "chained_optim_avoid_prefix": True}
    opt_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return {"model": model_sd, "optimizer": opt_sd}


class TestDistOptTorchAdamResume:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("fmt", ["dp_reshardable", "fully_reshardable"])
    def test_resume_equals_the_uninterrupted_run(self, tmp_path_dist_ckpt, fmt):
        model, optimizer = _model_and_optimizer()
        if not isinstance(optimizer.chained_optimizers[0].optimizer, torch.optim.Adam):
            pytest.skip(f"the defect is torch's Adam's; this run's is {type(optimizer)}")
        for seed in (1, 2):
            _step(model, optimizer, seed)
        with TempNamedDir(tmp_path_dist_ckpt / f"distopt_adam_{fmt}", sync=True) as ckpt_dir:
            dist_checkpointing.save(_sharded(model, optimizer, fmt, False), ckpt_dir)
            model2, optimizer2 = _model_and_optimizer()
            loaded = dist_checkpointing.load(_sharded(model2, optimizer2, fmt, True), ckpt_dir)
        model2.module.load_state_dict(loaded["model"])
        optimizer2.load_state_dict(loaded["optimizer"])
        for seed in (3, 4):
            _step(model, optimizer, seed)
            _step(model2, optimizer2, seed)
        differ = [
            name
            for (name, a), (_, b) in zip(
                model.module.named_parameters(), model2.module.named_parameters()
            )
            if not torch.equal(a, b)
        ]
        assert not differ
