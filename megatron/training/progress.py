"""--log-progress: Megatron-LM's ``{save}/progress.txt``, one tab-separated line per event.

    2026-01-01 10:00:00<TAB>Job ID: 1234<TAB># GPUs: 8<TAB>Starting job
    2026-01-01 11:00:00<TAB>Job ID: 1234<TAB># GPUs: 8<TAB>Saved checkpoint<TAB>Iteration: 1000
        <TAB>Job throughput: 41.2 TFLOP/s/GPU<TAB>Cumulative throughput: 40.9 TFLOP/s/GPU
        <TAB>Floating-point operations: 1.23e+18<TAB>Tokens (in billions): 2.05

Job throughput counts this job since its start; cumulative throughput the run of jobs with this
world size since the first of them started (read back from the file, so a requeued Slurm job
continues the figure). Model FLOPs are ``flops.py``'s, which are linear in the batch size:
FLOPs so far = consumed samples x FLOPs per sample, also across resumes and batch-size rampup.
Rank 0 writes; no collective.
"""

import os
import time
from datetime import datetime

import torch

from .flops import flops_per_iteration

STAMP = "%Y-%m-%d %H:%M:%S"


class ProgressLog:
    """Writes the start line at construction and a line after every checkpoint save."""

    def __init__(self, args, config, state, start_time: float):
        self.args = args
        self.path = os.path.join(args.save, "progress.txt")
        self.per_sample = flops_per_iteration(config, args.seq_length, args.padded_vocab_size, 1)
        self.job_start = start_time
        self.job_start_flops = state.consumed_train_samples * self.per_sample
        self._write("Starting job")

    def saved(self, state) -> None:
        """After a checkpoint of ``state`` is complete."""
        if torch.distributed.get_rank() != 0:
            return
        now = time.time()
        flops = state.consumed_train_samples * self.per_sample
        world = self.args.world_size
        job = (flops - self.job_start_flops) / ((now - self.job_start) * 1e12 * world)
        run_start, run_flops = run_started(self.path, world)
        run_start = run_start or self.job_start
        cumulative = (flops - run_flops) / (max(now - run_start, 1e-9) * 1e12 * world)
        tokens = state.consumed_train_samples * self.args.seq_length / 1e9
        self._write(
            f"Saved checkpoint\tIteration: {state.iteration}\t"
            f"Job throughput: {job:.1f} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
            f"Floating-point operations: {flops:.2e}\tTokens (in billions): {tokens:.2f}"
        )

    def _write(self, text: str) -> None:
        if torch.distributed.get_rank() != 0:
            return
        os.makedirs(self.args.save, exist_ok=True)
        job = os.environ.get("SLURM_JOB_ID", "")
        stamp = datetime.now().strftime(STAMP)
        with open(self.path, "a") as f:
            f.write(f"{stamp}\tJob ID: {job}\t# GPUs: {self.args.world_size}\t{text}\n")


def run_started(path: str, world: int) -> tuple:
    """(start time, FLOPs at that start) of the first job of the latest run of jobs with
    ``world`` ranks (a line of another world size starts a new run); (None, 0.0) if none."""
    start, start_flops, latest_flops = None, 0.0, 0.0
    with open(path) as f:
        for line in f:
            cells = line.rstrip("\n").split("\t")
            if len(cells) < 4:
                continue
            if cells[3] == "Saved checkpoint":
                latest_flops = float(cells[7].split(": ")[1])
            if int(cells[2].split(": ")[1]) != world:
                start = None
            elif cells[3] == "Starting job" and start is None:
                start = datetime.strptime(cells[0], STAMP).timestamp()
                start_flops = latest_flops
    return start, start_flops
