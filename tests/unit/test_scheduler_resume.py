"""Resuming the lr/wd schedule (checkpointing's scheduler load) with
--use-checkpoint-opt_param-scheduler: the param groups carry the checkpoint's schedule from the
first step after the resume, weight decay included.

megatron-core 0.16.1's OptimizerParamScheduler.load_state_dict applies the restored step count
(setting every group's lr and weight decay) before it reads the checkpoint's weight-decay
settings, so without a re-application the first step ran with the command line's weight decay.

    .venv/bin/python -m pytest -q tests/unit/test_scheduler_resume.py
"""

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.training.checkpointing import _load_scheduler


def _scheduler(lr: float, wd: float, use_checkpoint: bool = False) -> OptimizerParamScheduler:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr, weight_decay=wd)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=lr,
        min_lr=0.0,
        lr_warmup_steps=0,
        lr_decay_steps=100,
        lr_decay_style="constant",
        start_wd=wd,
        end_wd=wd,
        wd_incr_steps=100,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=use_checkpoint,
    )


def test_checkpoint_schedule_sets_the_groups_lr_and_weight_decay_at_once():
    saved = _scheduler(lr=0.1, wd=0.1)
    saved.step(increment=10)
    resumed = _scheduler(lr=0.2, wd=0.0, use_checkpoint=True)
    _load_scheduler(resumed, saved.state_dict())
    group = resumed.optimizer.param_groups[0]
    assert (resumed.num_steps, group["lr"], group["weight_decay"]) == (10, 0.1, 0.1)
