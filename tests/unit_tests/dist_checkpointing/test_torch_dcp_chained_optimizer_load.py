# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""load_checkpoint with --ckpt-format torch_dcp (what --use-torch-fsdp2 saves) asked the optimizer
for state_dict(is_loading=True); ChainedOptimizer, which get_megatron_optimizer returns, takes no
such argument, so every torch_dcp resume raised TypeError; and torch's SGD, whose momentum is made
at the first step, offered DCP no key for it, so a resume lost it. Here: save with torch_dcp,
then load into a fresh model and optimizer: the iteration, the scheduler, the weights and SGD's
momentum come back."""

import sys
from unittest import mock

import torch
from megatron.core.distributed import TorchFullyShardedDataParallel
from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
    TorchFullyShardedDataParallelConfig,
)
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

from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.training import arguments
from tests.unit_tests.dist_checkpointing import TempNamedDir


def tiny_gpt(**kwargs):
    """(config, a one-layer GPT on this rank's device); ``kwargs`` go to GPTModel. The
    fsdp_dtensor resume test (the same PR) builds on it, with ``step``, ``Scheduler``,
    ``checkpoint_args`` and ``ResumeTestSetup``."""
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
        **kwargs,
    )
    if torch.cuda.is_available():
        model.cuda()
    return config, model


def _model_and_optimizer():
    config, model = tiny_gpt(share_embeddings_and_output_weights=False)  # FSDP2 requires it
    model = TorchFullyShardedDataParallel(config, TorchFullyShardedDataParallelConfig(), model)
    return model, get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=1e-2), [model])


def step(model, optimizer):
    device = next(model.parameters()).device
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    position_ids = torch.arange(8, device=device).expand(2, 8)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool, device=device).tril().logical_not()
    optimizer.zero_grad()
    model.zero_grad_buffer()
    model(tokens, position_ids, mask, labels=tokens).float().mean().backward()
    model.finish_grad_sync()
    assert optimizer.step()[0]


def _full(tensor):
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().clone()


def _momentum(optimizer) -> dict:
    """{param index: its whole momentum buffer} of the chained SGD's params that have one."""
    sgd = optimizer.chained_optimizers[0].optimizer
    params = [p for group in sgd.param_groups for p in group["params"]]
    state = [sgd.state[p].get("momentum_buffer") for p in params]
    return {i: _full(buf) for i, buf in enumerate(state) if buf is not None}


class Scheduler:
    """The learning-rate scheduler's checkpoint interface."""

    def __init__(self, steps):
        self.steps = steps

    def state_dict(self):
        return {"num_steps": self.steps}

    def load_state_dict(self, state_dict):
        self.steps = state_dict["num_steps"]


def checkpoint_args(folder, ckpt_format="torch_dcp"):
    """Megatron-LM's args for save_checkpoint/load_checkpoint in ``folder``."""
    with mock.patch.object(sys, "argv", ["test"]):
        args = arguments.parse_args(ignore_unknown_args=True)
    args.save = args.load = str(folder)
    args.ckpt_format, args.use_dist_ckpt = ckpt_format, True  # as validate_args sets them
    args.save_interval = 1
    args.exit_on_missing_checkpoint = True
    args.tensor_model_parallel_size = args.pipeline_model_parallel_size = 1
    args.world_size = torch.distributed.get_world_size()
    args.data_parallel_size = args.world_size
    return args


class ResumeTestSetup:
    """One rank per DP rank, one micro-batch per step."""

    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)
        init_num_microbatches_calculator(0, None, 1, 1, 1)

    def teardown_method(self, method):
        unset_num_microbatches_calculator()
        Utils.destroy_model_parallel()


class TestTorchDcpChainedOptimizerLoad(ResumeTestSetup):
    def test_torch_dcp_resume_loads_a_chained_optimizer(self, tmp_path_dist_ckpt):
        with TempNamedDir(tmp_path_dist_ckpt / "torch_dcp_chained", sync=True) as folder:
            set_args(checkpoint_args(folder))
            model, optimizer = _model_and_optimizer()
            assert isinstance(optimizer, ChainedOptimizer)
            step(model, optimizer)
            save_checkpoint(7, [model], optimizer, Scheduler(7), 0)
            saved = {n: _full(p) for n, p in model.named_parameters()}

            fresh, fresh_optimizer = _model_and_optimizer()
            scheduler = Scheduler(0)
            iteration, _ = load_checkpoint([fresh], fresh_optimizer, scheduler, strict=True)
            assert iteration == 7 and scheduler.steps == 7
            for name, param in fresh.named_parameters():
                assert torch.equal(_full(param), saved[name]), name
            # SGD, not Adam: torch's Adam (no TE/Apex) hits another 0.19 defect on this load,
            # KeyError 'step' (fix-torch-adam-step). SGD's momentum: torch creates it at the
            # first step, so a fresh optimizer offered DCP nothing to load it into (before the
            # fix: no momentum_buffer after the load)
            momentum = _momentum(optimizer)
            assert len(momentum) == len(list(fresh.parameters()))
            loaded = _momentum(fresh_optimizer)
            assert loaded.keys() == momentum.keys()
            for index, value in momentum.items():
                assert torch.equal(loaded[index], value), index
