"""What a training step reports, when, and where: Megatron-LM's ``training_log`` schedule.

Every --tensorboard-log-interval steps (TensorBoard, last rank): this step's ``learning-rate``,
``batch-size``, losses (``lm loss``), ``loss-scale`` (unless --no-log-loss-scale-to-tensorboard),
``world-size`` (--log-world-size-to-tensorboard), ``grad-norm``, ``num-zeros``, ``params-norm``,
each also against consumed samples (``<tag> vs samples``), ``mem-*`` (--log-memory-to-tensorboard,
``log_memory.py``) and ``max_attention_logit``. Every step, as upstream: ``moe/<loss>_layer_<i>``
(--moe-per-layer-logging, ``moe_log.py``).

Every --log-interval steps (all ranks join: timers, params norm and Muon figures are
collectives): the console line (``log.training_line``), then the timers' report
(--timing-log-level, --timing-log-option), the memory line (--log-memory-interval), the CUDA
allocator's snapshot (--record-memory-history, last rank, ``memory_history.py``); in
TensorBoard with --log-timers-to-tensorboard ``iteration-time`` (s), ``throughput``
(--log-throughput) and ``<timer>-time`` (s per step, max over ranks); with --log-muon-figures
Muon's figures (``muon_figures.py``).
"""

import math

from megatron.core import parallel_state

from . import log_figures, log_memory, memory_history, moe_log, muon_figures
from .flops import flops_per_iteration
from .log import (
    IntervalStats,
    TensorBoard,
    is_last_rank,
    print_rank_last,
    throughput,
    training_line,
)
from .schedule import learning_rates
from .timers import Timers, gather_per_rank

# Megatron-LM's timers (names and levels as megatron-core 0.16.1 and Megatron-LM's loop set them)
LEVEL_1 = (
    "forward-backward",
    "all-grads-sync",
    "non-tensor-parallel-grads-all-reduce",
    "embedding-grads-all-reduce",
    "params-all-gather",
    "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad",
    "optimizer-count-zeros",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
    "optimizer",
)
LEVEL_2 = (
    "batch-generator",
    "forward-compute",
    "backward-compute",
    "forward-recv",
    "forward-send",
    "backward-recv",
    "backward-send",
    "forward-send-forward-recv",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
    *muon_figures.TIMERS,
)


def make_timers(args, device) -> Timers:
    """The run's timers: --timing-log-level and --timing-log-option; Muon's timers also run
    with --log-muon-figures."""
    always = muon_figures.TIMERS if args.log_muon_figures else ()
    return Timers(args.timing_log_level, args.timing_log_option, device, always=always)


def timer_names(args) -> list:
    names = list(LEVEL_1) if args.timing_log_level >= 1 else []
    names += LEVEL_2 if args.timing_log_level >= 2 else ()
    if args.log_muon_figures:
        names += [n for n in muon_figures.TIMERS if n not in names]
    return names


class TrainingLog:
    """Owns the interval statistics, the timers' reports and the TensorBoard writer."""

    def __init__(self, args, timers: Timers, device, config):
        self.args, self.timers, self.device = args, timers, device
        self.config = config  # the TransformerConfig: model FLOPs for --log-throughput
        self.tb = TensorBoard(args.tensorboard_dir, args.tensorboard_queue_size)
        self.stats = IntervalStats()
        self.progress = None  # a progress.ProgressLog with --log-progress

    def saved(self, state) -> None:
        """After a checkpoint save: --log-progress's line."""
        if self.progress is not None:
            self.progress.saved(state)

    def pause(self, seconds: float) -> None:
        self.stats.pause(seconds)

    def close(self) -> None:
        self.tb.close()

    def step(self, state, step, model, optimizer, batch_size) -> None:
        """After every training step, on every rank. ``step`` is train_step's result."""
        losses, skipped, (grad_norm, num_zeros), max_logit = step
        self.stats.add(losses, skipped, max_logit)
        args, it = self.args, state.iteration
        # --moe-per-layer-logging: every step, as megatron-core's track_moe_metrics writes them
        self.tb.scalars(moe_log.per_layer_figures(), it)
        to_tb = bool(args.tensorboard_dir) and it % args.tensorboard_log_interval == 0
        to_console = it % args.log_interval == 0
        if not (to_tb or to_console):
            return
        extra = log_figures.figures(args, model, num_zeros)  # a collective: every rank
        scale = optimizer.get_loss_scale().item()
        lrs = learning_rates(optimizer, args.decoupled_lr is not None)
        now = (lrs, scale, grad_norm, extra)
        if to_tb:
            self._tensorboard_step(state, losses, batch_size, now, max_logit)
        if to_console:
            self._interval(state, optimizer, batch_size, now)

    def _tensorboard_step(self, state, losses, batch_size, now, max_logit) -> None:
        (lrs, scale, grad_norm, extra), args = now, self.args
        by_samples = {"learning-rate": lrs[0], "batch-size": batch_size}
        by_samples.update(losses)
        if args.log_loss_scale_to_tensorboard:
            by_samples["loss-scale"] = scale
        if args.log_world_size_to_tensorboard:
            by_samples["world-size"] = args.world_size
        finite = grad_norm is not None and math.isfinite(grad_norm)
        by_samples["grad-norm"] = grad_norm if finite else None
        by_samples.update({log_figures.TAGS[k]: v for k, v in extra.items()})
        self.tb.scalars(by_samples, state.iteration, samples=state.consumed_train_samples)
        values = {"decoupled-learning-rate": lrs[1], "max_attention_logit": max_logit}
        values["skipped-train-samples"] = state.skipped_train_samples or None  # once > 0
        if args.log_memory_to_tensorboard and self.tb.writer is not None:  # the writing rank's
            values.update(log_memory.figures(self.device))
        self.tb.scalars(values, state.iteration)

    def _interval(self, state, optimizer, batch_size, now) -> None:
        lrs, scale, grad_norm, extra = now
        args = self.args
        memory_history.snapshot(args, is_last_rank())  # --record-memory-history
        self.stats.freeze()
        names = timer_names(args)
        ms = self.timers.seconds_per_rank(names) * (1000.0 / max(1, self.stats.iterations))
        muon = self._muon_figures(names, ms, optimizer) if args.log_muon_figures else {}
        tflops = self._tflops(batch_size) if args.log_throughput else None  # one clock reading
        line = training_line(
            args, state, self.stats, lrs, batch_size, scale, grad_norm, extra, tflops=tflops
        )
        print_rank_last(line + "".join(_muon_parts(muon)))
        report = self.timers.format(names, ms)
        if report and args.timing_log_level > 0:
            print_rank_last(report)
        self._memory_line(state.iteration)
        self._tensorboard_interval(state.iteration, tflops, (names, ms), muon)
        self.stats = IntervalStats()

    def _tflops(self, batch_size: int) -> float:
        args = self.args
        model_flops = flops_per_iteration(
            self.config, args.seq_length, args.padded_vocab_size, batch_size
        )
        return throughput(model_flops, self.stats, args.world_size)

    def _muon_figures(self, names, ms, optimizer) -> dict:
        per_step = {n: ms[:, names.index(n)].max().item() for n in muon_figures.TIMERS}
        busiest = gather_per_rank(muon_figures.counted(optimizer), self.device).max(0).values
        return muon_figures.figures(per_step, busiest.tolist())

    def _memory_line(self, iteration: int) -> None:
        interval = self.args.log_memory_interval
        if interval and iteration % interval == 0 and self._dp_rank_0():
            print(log_memory.report(iteration, self.device), flush=True)

    @staticmethod
    def _dp_rank_0() -> bool:
        return parallel_state.get_data_parallel_rank() == 0

    def _tensorboard_interval(self, iteration, tflops, timed, muon) -> None:
        (names, ms), args, values = timed, self.args, {}
        if args.log_timers_to_tensorboard:
            values["iteration-time"] = self.stats.seconds_per_iteration()
            if args.log_throughput:
                values["throughput"] = tflops
            for i, name in enumerate(names):
                top = ms[:, i].max().item()
                if top > 0.0:
                    values[name + "-time"] = top / 1000.0
        values.update(muon_figures.tensorboard(muon))
        self.tb.scalars(values, iteration)

    def validation(self, iteration: int, samples: int, losses: dict) -> None:
        """Megatron-LM's validation scalars: ``<loss> validation`` (+ ``ppl``, vs samples)."""
        values = {f"{k} validation": v for k, v in losses.items()}
        if self.args.log_validation_ppl_to_tensorboard:
            ppl = {f"{k} validation ppl": math.exp(min(20.0, v)) for k, v in losses.items()}
            values.update(ppl)
        self.tb.scalars(values, iteration, samples=samples)


def _muon_parts(figures: dict) -> list:
    return [f" {k}: {muon_figures.FORMATS[k].format(v)} |" for k, v in figures.items()]
