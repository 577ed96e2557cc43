# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""A Float16OptimizerWithFloat16Params whose param groups include an empty one (a group another
rank has params for: _get_param_groups makes every rank hold every group) did not resume from a
torch_dist checkpoint: dist_checkpointing keeps the empty group's [] in the common state but
drops the places of the sharded groups from the fp32_from_fp16_params list, so the load raised
"Cannot merge two lists with different lengths". The groups are now keyed by index; a
checkpoint in the list form (upstream's) still loads."""

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.test_utilities import Utils

from megatron.core import dist_checkpointing
from megatron.core.optimizer import OptimizerConfig
from tests.unit_tests.dist_checkpointing import TempNamedDir


def _model_and_optimizer(seed, empty_group=True):
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=4,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=8,
    )
    model.bfloat16()  # as Float16Module makes every param bf16
    if torch.cuda.is_available():
        model.cuda()
    params = list(model.parameters())
    # distinct identities, as _get_param_groups' groups have (param_group_identifier_keys)
    groups = [
        {"params": params[:2], "wd_mult": 1.0},
        {"params": [], "wd_mult": 0.5},
        {"params": params[2:], "wd_mult": 0.0},
    ]
    if not empty_group:
        del groups[1]
    adam = torch.optim.AdamW(groups, lr=1e-3)

    def init_state_fn(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)
                    opt.state[p]["step"] = torch.tensor(1.0)

    opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True)
    return model, Float16OptimizerWithFloat16Params(adam, opt_config, None, init_state_fn)


class TestFloat16EmptyGroupTorchDist:
    def setup_method(self, method):
        Utils.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(123)

    def teardown_method(self, method):
        Utils.destroy_model_parallel()

    def test_a_group_without_params_resumes(self, tmp_path_dist_ckpt):
        model, optimizer = _model_and_optimizer(seed=1)
        optimizer.init_state_fn(optimizer.optimizer)
        with TempNamedDir(tmp_path_dist_ckpt / "float16_empty_group", sync=True) as ckpt_dir:
            state = optimizer.sharded_state_dict(model.sharded_state_dict())
            dist_checkpointing.save(state, ckpt_dir)
            model2, optimizer2 = _model_and_optimizer(seed=2)
            before = [p.clone() for g in optimizer2.fp32_from_float16_groups for p in g]
            to_load = optimizer2.sharded_state_dict(model2.sharded_state_dict(), is_loading=True)
            # before the fix: "Cannot merge two lists with different lengths"
            optimizer2.load_state_dict(dist_checkpointing.load(to_load, ckpt_dir))
        saved = [p for g in optimizer.fp32_from_float16_groups for p in g]
        loaded = [p for g in optimizer2.fp32_from_float16_groups for p in g]
        assert [len(g) for g in optimizer2.fp32_from_float16_groups] == [2, 0, len(loaded) - 2]
        assert all(torch.equal(a, b) for a, b in zip(saved, loaded))
        assert not all(torch.equal(a, b) for a, b in zip(saved, before))  # seeds 1 and 2 differ

    def test_a_checkpoint_in_the_list_form_still_loads(self, tmp_path_dist_ckpt):
        model, optimizer = _model_and_optimizer(seed=1, empty_group=False)
        optimizer.init_state_fn(optimizer.optimizer)
        with TempNamedDir(tmp_path_dist_ckpt / "float16_list_form", sync=True) as ckpt_dir:
            state = optimizer.sharded_state_dict(model.sharded_state_dict())
            groups = state["fp32_from_fp16_params"]
            if isinstance(groups, dict):  # the list that upstream saves
                state["fp32_from_fp16_params"] = [groups[i] for i in range(len(groups))]
            dist_checkpointing.save(state, ckpt_dir)
            model2, optimizer2 = _model_and_optimizer(seed=2, empty_group=False)
            to_load = optimizer2.sharded_state_dict(model2.sharded_state_dict(), is_loading=True)
            optimizer2.load_state_dict(dist_checkpointing.load(to_load, ckpt_dir))
        saved = [p for g in optimizer.fp32_from_float16_groups for p in g]
        loaded = [p for g in optimizer2.fp32_from_float16_groups for p in g]
        assert all(torch.equal(a, b) for a, b in zip(saved, loaded))
