"""Console lines in Megatron-LM's format (existing log parsers keep working) and TensorBoard.

Megatron-LM prints the training line from the last rank (the one holding the loss); so do we.
"""

import datetime
import math
import time

import torch

from .log_figures import FORMATS as FIGURE_FORMATS


def is_last_rank() -> bool:
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def print_rank_0(message: str) -> None:
    if torch.distributed.get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message: str) -> None:
    if is_last_rank():
        print(message, flush=True)


class IntervalStats:
    """Sums over one --log-interval: losses of non-skipped steps, skipped and nan counts (as
    Megatron-LM: skipped steps whose loss was not finite, once per step), and the max attention
    logit of the interval's steps (None unless QK-clip or its log is on)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.iterations = self.skipped = self.nan = 0
        self.losses: dict = {}
        self.max_logit = None
        self.end = None

    def pause(self, seconds: float) -> None:
        """Leave evaluation and checkpoint time out of the per-iteration time, as Megatron-LM."""
        self.start += seconds

    def add(self, losses: dict, skipped: bool, max_logit=None) -> None:
        self.iterations += 1
        if max_logit is not None:
            self.max_logit = max_logit if self.max_logit is None else max(self.max_logit, max_logit)
        self.skipped += int(skipped)
        if skipped:
            self.nan += int(not all(math.isfinite(value) for value in losses.values()))
            return
        for key, value in losses.items():
            self.losses[key] = self.losses.get(key, 0.0) + value

    def freeze(self) -> None:
        """Stop the clock: every figure of one log line reads the same interval."""
        self.end = time.perf_counter()

    def seconds_per_iteration(self) -> float:
        end = self.end if self.end is not None else time.perf_counter()
        return (end - self.start) / max(1, self.iterations)

    def averages(self) -> dict:
        counted = max(1, self.iterations - self.skipped)
        return {key: total / counted for key, total in self.losses.items()}


def training_line(
    args,
    state,
    stats: IntervalStats,
    lrs,
    batch_size,
    loss_scale,
    grad_norm,
    extra=None,
    *,
    tflops=None,
):
    """One Megatron-LM training log line, plus tokens/s and ETA (ours). ``lrs``: the learning
    rate and the decoupled one (None without --decoupled-lr); ``tflops``: the throughput per
    GPU (``throughput``), printed with --log-throughput."""
    lr, decoupled_lr = lrs
    elapsed = stats.seconds_per_iteration()
    tokens_per_s = batch_size * args.seq_length / elapsed
    eta = datetime.timedelta(seconds=int(elapsed * (args.train_iters - state.iteration)))
    parts = [
        f" iteration {state.iteration:8d}/{args.train_iters:8d}",
        f" consumed samples: {state.consumed_train_samples:12d}",
    ]
    if state.skipped_train_samples:  # --iterations-to-skip, as Megatron-LM
        parts.append(f" skipped samples: {state.skipped_train_samples:12d}")
    parts += [
        f" elapsed time per iteration (ms): {elapsed * 1000.0:.1f}",
        f" tokens per second: {tokens_per_s:.1f}",
        f" ETA: {eta}",
    ]
    if args.log_throughput:
        parts.append(f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f}")
    parts.append(f" learning rate: {lr:.6E}")
    if decoupled_lr is not None:
        parts.append(f" decoupled learning rate: {decoupled_lr:.6E}")
    parts.append(f" global batch size: {batch_size:5d}")
    parts += [f" {key}: {value:.6E}" for key, value in stats.averages().items()]
    parts += [f" loss scale: {loss_scale:.1f}"]
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f}")
    for key, value in (extra or {}).items():  # log_figures: num zeros, params norm
        parts.append(f" {key}: {FIGURE_FORMATS[key].format(value)}")
    if stats.max_logit is not None:
        parts.append(f" max attention logit: {stats.max_logit:.6E}")
    parts += [
        f" number of skipped iterations: {stats.skipped:3d}",
        f" number of nan iterations: {stats.nan:3d}",
    ]
    return "".join(part + " |" for part in parts)


def throughput(flops_per_iteration: float, stats: IntervalStats, world_size: int) -> float:
    """TFLOP/s per GPU (Megatron-LM's): model FLOPs of an iteration (``flops.py``) over the
    interval's seconds per iteration, shared by all ranks of the world."""
    return flops_per_iteration / (stats.seconds_per_iteration() * 1e12 * world_size)


def validation_block(label: str, losses: dict) -> str:
    text = f" validation loss at {label} | "
    for key, value in losses.items():
        ppl = math.exp(min(20.0, value))
        text += f"{key} value: {value:.6E} | {key} PPL: {ppl:.6E} | "
    rule = "-" * (len(text) + 1)
    return f"{rule}\n{text}\n{rule}"


class TensorBoard:
    """Scalars under --tensorboard-dir, written by the last rank (it has the loss)."""

    def __init__(self, log_dir, queue_size: int = 1000):
        self.writer = None
        if log_dir and is_last_rank():
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def scalars(self, values: dict, step: int, samples=None) -> None:
        """Each value at ``step``; with ``samples`` also as ``<tag> vs samples`` at that
        consumed-sample count (Megatron-LM's second axis). None values are left out."""
        if self.writer is None:
            return
        for key, value in values.items():
            if value is not None:
                self.writer.add_scalar(key, value, step)
                if samples is not None:
                    self.writer.add_scalar(key + " vs samples", value, samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
