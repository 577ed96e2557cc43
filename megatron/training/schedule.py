"""How long to train and the learning-rate / weight-decay schedule, as Megatron-LM counts them.

Two exclusive forms (validation.py enforces it, as upstream):
- iteration-based: --train-iters, --lr-decay-iters, --lr-warmup-iters, --lr-wsd-decay-iters;
- sample-based: --train-samples, --lr-decay-samples, --lr-warmup-samples,
  --lr-wsd-decay-samples, and only here --rampup-batch-size (the batch grows with the samples).
Megatron-core's OptimizerParamScheduler counts in samples either way (it is stepped by the
global batch size), so an iteration-based flag is scaled by --global-batch-size.
Param groups may carry their own ``max_lr``/``min_lr`` (--decoupled-lr / --decoupled-min-lr on
the embedding and output layer): the scheduler reads them per group.
"""

from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def train_iters_from_samples(args) -> int:
    """Optimizer steps of a --train-samples run: Megatron-LM's update_train_iters. With
    --rampup-batch-size the steps of the ramp are counted one batch size at a time; a last
    partial global batch is dropped."""
    if args.rampup_batch_size is None:
        return args.train_samples // args.global_batch_size
    start, increment, ramp = (int(x) for x in args.rampup_batch_size)
    calculator = RampupBatchsizeNumMicroBatchesCalculator(
        args.global_batch_size,
        args.micro_batch_size,
        args.data_parallel_size,
        False,
        0,
        start,
        increment,
        ramp,
    )
    iterations = consumed = 0
    while consumed <= ramp and consumed <= args.train_samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations


def schedule_steps(args) -> dict:
    """The scheduler's step counts (in samples) from the iteration or the sample flags."""
    if args.train_samples is None:
        gbs = args.global_batch_size
        decay = args.lr_decay_iters * gbs
        warmup = args.lr_warmup_iters * gbs
        wsd = args.lr_wsd_decay_iters * gbs if args.lr_wsd_decay_iters else None
        total = args.train_iters * gbs
    else:
        decay = args.lr_decay_samples
        warmup = args.lr_warmup_samples
        wsd = args.lr_wsd_decay_samples
        total = args.train_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return dict(lr_warmup_steps=warmup, lr_decay_steps=decay, wsd_decay_steps=wsd, total=total)


def get_scheduler(args, optimizer) -> OptimizerParamScheduler:
    """Megatron-LM's get_optimizer_param_scheduler."""
    steps = schedule_steps(args)
    wd = args.weight_decay
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr or 0.0,
        lr_warmup_steps=steps["lr_warmup_steps"],
        lr_decay_steps=steps["lr_decay_steps"],
        lr_decay_style=args.lr_decay_style,
        start_wd=wd if args.start_weight_decay is None else args.start_weight_decay,
        end_wd=wd if args.end_weight_decay is None else args.end_weight_decay,
        wd_incr_steps=steps["total"],
        wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=steps["wsd_decay_steps"],
        lr_wsd_decay_style=args.lr_wsd_decay_style,
        # Megatron-LM's CLI: by default a resumed schedule must equal the command line's
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
    )


def learning_rates(optimizer, decoupled: bool) -> tuple:
    """(lr, decoupled lr or None) for the log: the lr of a group on the default schedule, and
    with --decoupled-lr that of a group with its own schedule (Megatron-LM logs both)."""
    lr = other = None
    for group in optimizer.param_groups:
        if group.get("default_config", True):
            lr = group["lr"] if lr is None else lr
        elif decoupled and other is None:
            other = group["lr"]
    return (optimizer.param_groups[0]["lr"] if lr is None else lr), other
