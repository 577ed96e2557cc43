# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""muon_tp_mode='owner' (muon_impl='megatron_muon'): each TP-sharded matrix is orthogonalized
whole once, on one rank of the TP group, reached by one all-to-all each way, where 'duplicated'
gathers it and runs the same Newton-Schulz on every TP rank. Both are exact: one step at TP 2
is the same in either mode, and differs from 'blockwise' (each shard on its own, the control)."""

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

# fp32: owner and duplicated run Newton-Schulz on the same whole matrix; only where the TP
# all-to-all or all-gather puts the pieces differs. blockwise misses by O(1) of the update.
RTOL = 1e-5


def _step(mode, weights=None):
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=2,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
    )
    if weights is not None:  # the first run's initial weights (this rank's shards)
        for name, param in model.named_parameters():
            param.data.copy_(weights[name])
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    model.to(device)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="muon", muon_impl="megatron_muon", muon_tp_mode=mode, lr=1e-2
    )
    optimizer = get_megatron_optimizer(opt_config, [model])
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    position_ids = torch.arange(16, device=device).expand(2, 16)
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool, device=device).tril().logical_not()
    model.zero_grad_buffer()
    model(tokens, position_ids, mask, labels=tokens).float().mean().backward()
    model.finish_grad_sync()
    assert optimizer.step()[0]
    return initial, {n: p.detach().clone() for n, p in model.module.named_parameters()}


def _errors(got, expected, initial):
    """Each TP-sharded matrix's error relative to its update."""
    return {
        n: ((got[n] - e).norm() / (e - initial[n]).norm()).item()
        for n, e in expected.items()
        if e.dim() == 2 and "layers" in n
    }


class TestMegatronMuonTPOwner:
    def setup_method(self, method):
        Utils.initialize_model_parallel(2, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_owner_step_equals_duplicated_and_not_blockwise(self):
        initial, duplicated = _step("duplicated")
        _, owner = _step("owner", initial)
        _, blockwise = _step("blockwise", initial)
        errors = _errors(owner, duplicated, initial)
        assert errors and not {n: e for n, e in errors.items() if not e < RTOL}
        control = _errors(blockwise, duplicated, initial)
        assert max(control.values()) > 100 * RTOL  # the comparison sees a per-shard NS
