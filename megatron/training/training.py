"""The training loop: Megatron-LM's ``pretrain`` on megatron-core's building blocks.

    pretrain(args, model_provider, forward_step, datasets_provider)

Model chunks (one per virtual pipeline stage) wrapped in Float16Module for bf16/fp16 and in DDP;
``get_megatron_optimizer`` (Adam, SGD or Muon; DistributedOptimizer on request);
OptimizerParamScheduler; gradient accumulation to the global batch by the micro-batch calculator
(with --rampup-batch-size); pipeline schedules from ``get_forward_backward_func`` (1F1B, or
interleaved with virtual stages); evaluation, checkpoints, Megatron-LM log lines.
"""

import dataclasses
import functools
import time
from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megatron.core import parallel_state
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.qk_clip import clip_qk

from . import checkpointing, failures, memory, memory_history, moe_log, mtp_log, muon_figures, rerun
from .arguments import ArgumentsError
from .core_configs import ddp_config, optimizer_config
from .exit_conditions import ExitConditions
from .log import print_rank_0, print_rank_last, validation_block
from .profiling import StepProfiler
from .progress import ProgressLog
from .schedule import get_scheduler
from .timers import started, suspended
from .train_log import TrainingLog, make_timers


@dataclass
class TrainState:
    """What a checkpoint must carry besides model/optimizer/scheduler/RNG to continue exactly."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_train_samples: int = 0  # of --iterations-to-skip; counted in consumed samples too
    num_params: int = 0
    pending_rng_state: dict | None = None  # loaded, applied after the data iterators exist
    exit_code: int = 0  # the process's: the rerun state machine's when it ended the run


# ------------------------------------------------------------------------------------ model


def get_model(args, model_provider, config):
    """One DDP-wrapped chunk per virtual pipeline stage (one without virtual stages)."""
    chunks = []
    vpp = config.virtual_pipeline_model_parallel_size
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=vp_stage)
        module = model_provider(pre_process=pre, post_process=post, vp_stage=vp_stage)
        if args.bf16 or args.fp16:
            module = Float16Module(config, module)
        chunks.append(module)
    ddp = ddp_config(args, sum(p.numel() for chunk in chunks for p in chunk.parameters()))
    return [_wrap_ddp(config, ddp, chunk, i) for i, chunk in enumerate(chunks)]


def _wrap_ddp(config, ddp, chunk, index):
    # Megatron-LM: only the first chunk uses buckets, so later chunks' grads reduce at once.
    return DistributedDataParallel(
        config=config, ddp_config=ddp, module=chunk, disable_bucketing=index > 0
    )


def _hook_up_schedule(args, config, model) -> None:
    """Grad sync / no-sync / param sync callbacks that the pipeline schedules call."""
    one_or_list = lambda fs: fs[0] if len(fs) == 1 else fs  # noqa: E731
    config.no_sync_func = one_or_list([chunk.no_sync for chunk in model])
    config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce:
        config.grad_sync_func = one_or_list([chunk.start_grad_sync for chunk in model])
    if args.overlap_param_gather:
        config.param_sync_func = one_or_list([chunk.start_param_sync for chunk in model])


def count_parameters(model) -> int:
    """Parameters of the whole model (all TP/PP ranks; expert params counted per EP rank)."""
    local = sum(p.numel() for chunk in model for p in chunk.parameters())
    total = torch.tensor([local], dtype=torch.float64, device=_device())
    torch.distributed.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return int(total.item())


def _device():
    from megatron.training import cpu_mode

    return cpu_mode.device()


# -------------------------------------------------------------------- optimizer and schedule


def setup_model_and_optimizer(args, model_provider, config):
    """``config.timers`` (Megatron's timers, when set) also time the optimizer's phases."""
    memory_history.start(args)  # --record-memory-history: before the model, as Megatron-LM
    model = get_model(args, model_provider, config)
    _hook_up_schedule(args, config, model)
    opt_config = optimizer_config(args)
    opt_config.timers = config.timers
    try:
        optimizer = get_megatron_optimizer(opt_config, model)
    except ValueError as err:  # the factory refuses a combination of optimizer settings
        raise ArgumentsError(f"--optimizer {args.optimizer}: {err}") from err
    config.grad_scale_func = optimizer.scale_loss
    scheduler = get_scheduler(args, optimizer)
    return model, optimizer, scheduler


# ------------------------------------------------------------------------------ steps


def run_schedule(args, forward_step, data_iterator, model, forward_only: bool, microbatches=None):
    """One global batch through the pipeline schedule: ``microbatches`` micro-batches per DP
    rank, by default the calculator's current count (the --rampup-batch-size ramp's)."""
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=microbatches or get_num_microbatches(),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=forward_only,
    )


def reduce_losses(outputs: list) -> dict:
    """{name: token-weighted mean over the global batch} from the last stage's per-micro-batch
    [loss sum, token count] pairs, summed over DP. Empty on other stages."""
    if not outputs:
        return {}
    reduced = {}
    for key in outputs[0]:
        pair = torch.stack([out[key] for out in outputs]).sum(0).to(torch.float64)
        torch.distributed.all_reduce(pair, group=parallel_state.get_data_parallel_group())
        reduced[key] = (pair[0] / pair[1]).item()
    return reduced


def train_step(args, forward_step, data_iterator, model, optimizer, scheduler, iteration=None):
    """One iteration; returns (losses, skipped, (grad norm, num zeros), max attention logit).
    The rerun state machine may run the forward and backward again on the same micro-batches
    (``data_iterator`` wrapped by rerun.wrap) and RNG state, or end the run (rerun.Stop)."""
    judged = rerun.judges_nan(args)  # known before the step: from the machine's second step on
    for _ in rerun.steps(data_iterator):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        moe_log.start_step()  # --num-experts: the routers' losses of this (re-)run only
        mtp_log.start_step()
        outputs = run_schedule(args, forward_step, data_iterator, model, forward_only=False)
    memory.empty_cache(args.empty_unused_memory_level, 1, _device())
    if args.check_for_nan_in_loss_and_grad and not judged:
        # What the machine does not judge (disabled or report_stats, the first step),
        # collectively. fp16's loss scaler already skips steps with inf/NaN grads.
        grads = [] if args.fp16 else failures.model_grad_buffers(model)
        failures.check_finite(outputs, grads, iteration, _device())
    timer = started(model[0].config.timers, "optimizer", 1, args.barrier_with_L1_time)
    ok, grad_norm, num_zeros = optimizer.step()
    timer.stop()
    max_logit = clip_qk(model, optimizer=optimizer)  # --qk-clip / --log-max-attention-logit
    memory.empty_cache(args.empty_unused_memory_level, 2, _device())
    if ok:
        scheduler.step(increment=get_current_global_batch_size())
    losses = reduce_losses(outputs)
    losses.update(mtp_log.mtp_losses(get_num_microbatches()))  # --mtp-num-layers: mtp_<k> loss
    losses.update(moe_log.moe_losses(args, get_num_microbatches(), _device()))
    return losses, not ok, (grad_norm, num_zeros), max_logit


@torch.no_grad()
def evaluate(args, forward_step, data_iterator, model, state, advance=True, stop=None) -> dict:
    """Mean losses over --eval-iters batches of --global-batch-size samples (during a
    --rampup-batch-size ramp too: Megatron-LM's evaluation batch is independent of the training
    batch); ``advance``: count them in the state's consumed validation samples. With
    --exit-duration-in-mins (``stop``, the run's ExitConditions) a time limit reached after a
    batch ends the evaluation without a result, as Megatron-LM, so the loop saves and exits."""
    for chunk in model:
        chunk.eval()
    totals: dict | None = {}
    micro = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    with suspended(model[0].config), rerun.evaluating():  # the chunks share one config
        for _ in range(args.eval_iters):
            outputs = run_schedule(args, forward_step, data_iterator, model, True, micro)
            memory.empty_cache(args.empty_unused_memory_level, 1, _device())
            for key, value in reduce_losses(outputs).items():
                totals[key] = totals.get(key, 0.0) + value
            state.consumed_valid_samples += args.global_batch_size if advance else 0
            if stop is not None and stop.time_up(_device()):
                totals = None
                break
    for chunk in model:
        chunk.train()
    if totals is None:
        print_rank_0("Exiting during evaluation, timelimit reached")  # Megatron-LM's words
        return {}
    return {key: total / args.eval_iters for key, total in totals.items()}


# ------------------------------------------------------------------------------- loop


def pretrain(
    args, model_provider, forward_step, data_iterators_provider, config, exit_conditions=None
) -> TrainState:
    """Build, resume, train, evaluate, save. ``data_iterators_provider(args, state, n_chunks)``
    returns (train, valid, test): iterators (lists with virtual stages; None on ranks that read
    no data; False for a split no rank has), train and valid from the state's consumed sample
    counts, so that a resumed run reads exactly the data the uninterrupted one would. After the
    last step (not after an early exit) the validation and test splits are evaluated once more,
    as Megatron-LM's pretrain does.
    ``exit_conditions`` (made at process start, so that its signal handler and clock cover
    start-up) decides early exits; one is made here when not given."""
    exit_conditions = exit_conditions or ExitConditions(args, time.time())
    config.timers = make_timers(args, _device())  # megatron-core's schedules and optimizer
    model, optimizer, scheduler = setup_model_and_optimizer(args, model_provider, config)
    rerun.initialize(args, model)  # before a --load that may hold a step to re-run
    state = TrainState(num_params=count_parameters(model))
    print_rank_0(f" > number of parameters: {state.num_params}")
    if torch.distributed.get_rank() == 0:  # rank 0's DP group; built at start, every step runs it
        for plan in muon_figures.plans(optimizer):
            print(f" > {plan.summary()}", flush=True)
    if args.exit_on_missing_checkpoint and checkpointing.read_tracker(args.load) is None:
        print_rank_0(f" > --exit-on-missing-checkpoint: no checkpoint in --load {args.load}")
        exit_conditions.release()
        return state  # Megatron-LM exits here (code 0), before any data or step
    if args.load:
        checkpointing.load(args, model, optimizer, scheduler, state)
    update_num_microbatches(state.consumed_train_samples, consistency_check=False)
    train_iter, valid_iter, test_iter = data_iterators_provider(args, state, len(model))
    train_iter = rerun.wrap(train_iter)  # a re-run of a step replays its micro-batches
    if args.eval_iters == 0:  # Megatron-LM: no validation or test evaluation
        valid_iter = test_iter = False
    checkpointing.restore_pending_rng(state)
    log = TrainingLog(args, config.timers, _device(), config)
    if args.log_progress:
        log.progress = ProgressLog(args, config, state, exit_conditions.start_time)
    iterators = (train_iter, valid_iter)
    collector = memory.ManualGC(args.manual_gc, args.manual_gc_interval, args.manual_gc_eval)
    with collector:
        loop = (log, exit_conditions, collector)
        if args.skip_train:  # Megatron-LM's: evaluate what --load holds, train nothing
            print_rank_0(" > skipping training (--skip-train is on) ...")
            reason = None
        else:
            reason = train_loop(
                args, forward_step, model, optimizer, scheduler, state, iterators, loop
            )
    if not reason:  # Megatron-LM exits before these after an early exit
        logs = (log, exit_conditions)
        _evaluate_and_print(args, forward_step, valid_iter, model, state, logs, "validation")
        _evaluate_and_print(args, forward_step, test_iter, model, state, logs, "test")
    log.close()
    exit_conditions.release()
    if reason:
        print_rank_0(f" > {reason}")
    return state


def train_loop(args, forward_step, model, optimizer, scheduler, state, iterators, loop):
    """Steps until --train-iters or an early exit (returned as its reason), then a final save.
    ``loop`` is (TrainingLog, ExitConditions, memory.ManualGC)."""
    log, stop, collector = loop
    train_iter, valid_iter = iterators  # valid_iter False: no evaluation (None: reads no data)
    reason = None
    saved_at = None
    profiler = StepProfiler(args, torch.distributed.get_rank())
    micro_batches = get_num_microbatches()
    while state.iteration < args.train_iters:
        profiler.before_step(state.iteration)
        checkpointing.finalize_async_saves()  # publish --async-save checkpoints already written
        update_num_microbatches(state.consumed_train_samples, consistency_check=True)
        if _batch_grew(args, state, micro_batches, saved_at):
            saved_at = _save_paused(args, model, optimizer, scheduler, state, log)
        micro_batches = get_num_microbatches()
        batch_size = get_current_global_batch_size()
        if state.iteration in args.iterations_to_skip:  # Megatron-LM's index: steps done so far
            _skip_step(train_iter, state, batch_size)
            continue
        try:
            step = train_step(
                args, forward_step, train_iter, model, optimizer, scheduler, state.iteration + 1
            )
        except rerun.Stop as stopped:
            reason = _rerun_stop(args, (model, optimizer, scheduler), state, train_iter, stopped)
            saved_at = state.iteration  # no final save: the machine's own checkpoint or none
            break
        state.iteration += 1
        state.consumed_train_samples += batch_size
        log.step(state, step, model, optimizer, batch_size)
        profiler.after_step(state.iteration)
        paused = time.perf_counter()
        if valid_iter is not False and state.iteration % args.eval_interval == 0:
            collector.before_eval()
            _evaluate_and_print(args, forward_step, valid_iter, model, state, (log, stop))
            collector.after_eval()
        if args.save_interval and state.iteration % args.save_interval == 0:
            _save(args, model, optimizer, scheduler, state, log)
            saved_at = state.iteration
        log.pause(time.perf_counter() - paused)
        reason = stop.check(state.iteration, _device())
        if reason:
            break
        collector.after_step(state.iteration)  # Megatron-LM: last in the iteration
    profiler.stop()  # a run that ended before --profile-step-end still writes its trace
    if args.save and saved_at != state.iteration:
        _save(args, model, optimizer, scheduler, state, log)
    checkpointing.finalize_async_saves(blocking=True)  # no async save outlives the run
    return reason


def _rerun_stop(args, parts, state, train_iter, stopped) -> str:
    """The rerun state machine ends the run before this step's update, as Megatron-LM: a
    checkpoint of the steps done so far (with the machine's state: the step to re-run, its
    micro-batches) when it asks for one and --save is given; the process exits with its code."""
    state.exit_code = stopped.code
    if stopped.checkpoint and args.save:
        model, optimizer, scheduler = parts
        # --async-save: the interval save of this same iteration may still be in flight into
        # the folder this save writes; publish it first (this one then replaces it)
        checkpointing.finalize_async_saves(blocking=True)
        machine_state = rerun.state_dict(train_iter)
        checkpointing.save(args, model, optimizer, scheduler, state, rerun_state=machine_state)
    elif stopped.checkpoint:
        print_rank_0(" > the rerun state machine asked for a checkpoint: no --save, none written")
    return (
        f"rerun state machine: stopped before the update of iteration {state.iteration + 1} "
        f"(exit code {stopped.code})"
    )


def _skip_step(train_iter, state, batch_size: int) -> None:
    """--iterations-to-skip: this step's micro-batches are read and dropped (the data moves on
    as if trained), the iteration and sample counts advance; no forward, no update, no lr
    step, no log line, evaluation, save or exit check, as Megatron-LM's dummy_train_step."""
    for iterator in train_iter if isinstance(train_iter, list) else [train_iter]:
        if iterator is None:  # this rank reads no data
            continue
        for _ in range(get_num_microbatches()):
            next(iterator)
    rerun.drop_batches(train_iter)  # nothing of a dropped step is replayed
    state.iteration += 1
    state.consumed_train_samples += batch_size
    state.skipped_train_samples += batch_size
    print_rank_0(f" > iteration {state.iteration} skipped (--iterations-to-skip): batch dropped")


def _batch_grew(args, state, micro_batches: int, saved_at) -> bool:
    """Megatron-LM saves a checkpoint (with --save) before the first step of each larger
    --rampup-batch-size batch, unless this iteration is saved already."""
    grew = get_num_microbatches() != micro_batches and state.iteration != 0
    return grew and bool(args.save) and saved_at != state.iteration


def _save_paused(args, model, optimizer, scheduler, state, log) -> int:
    """A save between steps, left out of the interval's time per iteration; its iteration."""
    start = time.perf_counter()
    _save(args, model, optimizer, scheduler, state, log)
    log.pause(time.perf_counter() - start)
    return state.iteration


def _save(args, model, optimizer, scheduler, state, log) -> None:
    """Save; --log-progress's line once the checkpoint is complete (an async one later: it gets
    the state as it was at the save)."""
    on_saved = functools.partial(log.saved, dataclasses.replace(state))
    checkpointing.save(args, model, optimizer, scheduler, state, on_saved=on_saved)


def _evaluate_and_print(args, forward_step, iterator, model, state, logs, final=None) -> None:
    """An evaluation in the loop (``final`` None), or after the last step of the ``final`` split
    ("validation" or "test"), labelled as Megatron-LM labels it. The test split's loss is printed
    only (Megatron-LM writes it under the validation tags) and leaves the validation position.
    ``logs``: (TrainingLog, ExitConditions)."""
    if iterator is False:  # no such split, or --eval-iters 0 (pretrain)
        return
    log, stop = logs
    is_test = final == "test"
    losses = evaluate(args, forward_step, iterator, model, state, not is_test, stop)
    if not losses:  # not the last pipeline stage
        return
    label = f"iteration {state.iteration}" + (f" on {final} set" if final else "")
    print_rank_last(validation_block(label, losses))
    if not is_test:
        log.validation(state.iteration, state.consumed_train_samples, losses)
