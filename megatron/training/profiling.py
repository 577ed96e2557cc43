"""Megatron-LM's ``--profile``: profile the steps ``--profile-step-start`` to
``--profile-step-end`` on the ranks in ``--profile-ranks``.

With ``--use-pytorch-profiler`` a ``torch.profiler`` trace (shapes and stacks) is written under
``--tensorboard-dir`` (TensorBoard's profiler plugin, or chrome://tracing / Perfetto read the
``*.pt.trace.json``); this works on CPU too. Without it the steps get an Nsight Systems capture
range (``cudaProfilerStart`` / ``cudaProfilerStop`` with NVTX ranges per op), for
``nsys profile --capture-range=cudaProfilerApi``: CUDA only. The schedule is Megatron-LM's:
``torch.profiler.schedule(wait=start - 1, warmup=1, active=end - start)``, stepped before each
training step of this run, records steps ``start`` to ``end - 1`` (counted from 1 in this run);
the Nsight range opens before step ``start + 1`` (counted as iterations, resumed ones too) and
closes after step ``end``: the two paths differ by one step, as in Megatron-LM. Additions: a run
that ends inside the window stops the profiler at its end, so its trace is written; one that
ends before it says that nothing was recorded.
"""

import torch

_CONFIGURES = (
    ("use_pytorch_profiler", "--use-pytorch-profiler"),
    ("profile_step_start", "--profile-step-start"),
    ("profile_step_end", "--profile-step-end"),
    ("profile_ranks", "--profile-ranks"),
)


def _configuring(a) -> list[str]:
    return [flag for dest, flag in _CONFIGURES if dest in a.given]


def _bad_ranks(a) -> list[int]:
    return [r for r in a.profile_ranks if not 0 <= r < a.world_size]


RULES = (
    (
        lambda a: not a.profile and _configuring(a),
        lambda a: f"{', '.join(_configuring(a))} configure --profile, which is not given: add "
        "--profile or drop them",
    ),
    (
        lambda a: a.profile and not a.use_pytorch_profiler and not torch.cuda.is_available(),
        lambda a: "--profile without --use-pytorch-profiler opens an Nsight Systems capture "
        "range (cudaProfilerStart), which needs CUDA; add --use-pytorch-profiler for a "
        "torch.profiler trace",
    ),
    (
        lambda a: a.profile and a.use_pytorch_profiler and not a.tensorboard_dir,
        lambda a: "--use-pytorch-profiler writes its trace under --tensorboard-dir: give one",
    ),
    (
        lambda a: a.profile and not 0 <= a.profile_step_start < a.profile_step_end,
        lambda a: f"--profile-step-end ({a.profile_step_end}) must be greater than "
        f"--profile-step-start ({a.profile_step_start}), which must be >= 0",
    ),
    (
        lambda a: a.profile and _bad_ranks(a),
        lambda a: f"--profile-ranks {_bad_ranks(a)}: not ranks of this run (0 to "
        f"{a.world_size - 1})",
    ),
)


class StepProfiler:
    """Starts, steps and stops the profiler around the training steps of one rank.

    Args:
        args: the parsed arguments (``--profile`` and its settings, ``--tensorboard-dir``).
        rank: this process's global rank.
    """

    def __init__(self, args, rank: int):
        self.args = args
        self.on = bool(args.profile) and rank in args.profile_ranks
        self.torch_profiler = None
        self.nvtx = None
        self.steps = 0  # before_step calls: steps this run started
        if self.on and args.use_pytorch_profiler:
            start, end = args.profile_step_start, args.profile_step_end
            self.torch_profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(
                    wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start
                ),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(args.tensorboard_dir),
                record_shapes=True,
                with_stack=True,
            )
            self.torch_profiler.start()

    def before_step(self, iteration: int) -> None:
        """Called before the step that follows ``iteration`` (the steps done so far)."""
        if not self.on:
            return
        self.steps += 1
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif iteration == self.args.profile_step_start:
            torch.cuda.cudart().cudaProfilerStart()
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.nvtx.__enter__()

    def after_step(self, iteration: int) -> None:
        """Called once step ``iteration`` is done: the capture ends after --profile-step-end."""
        if self.on and iteration == self.args.profile_step_end:
            self.stop()

    def stop(self) -> None:
        """End the capture (writing the torch.profiler trace); later calls do nothing. Says so
        where the run ended before the window began: nothing was recorded."""
        if self.on and self._recorded_nothing():
            print(
                f" > --profile: this run ended before --profile-step-start "
                f"({self.args.profile_step_start}): nothing recorded",
                flush=True,
            )
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
        elif self.nvtx is not None:
            self.nvtx.__exit__(None, None, None)
            torch.cuda.cudart().cudaProfilerStop()
        self.on, self.torch_profiler, self.nvtx = False, None, None

    def _recorded_nothing(self) -> bool:
        if self.torch_profiler is not None:  # it records steps start .. end - 1
            return self.steps < self.args.profile_step_start
        return self.nvtx is None  # the capture range opens before step start + 1
