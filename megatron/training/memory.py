"""--manual-gc and --empty-unused-memory-level, at Megatron-LM's points in the loop.

Manual GC: Python's automatic collector runs whenever allocation counts cross a threshold, i.e. at
a different moment on each rank, and a rank paused in a collection stalls its peers in the next
collective. With --manual-gc the collector is disabled for the run and collected explicitly at the
same iterations on every rank: every --manual-gc-interval steps (0: never, as upstream), fully
before an evaluation and young objects (generation 0) after it (not with --no-manual-gc-eval).

Emptying the cache: level 1 releases the device allocator's cached blocks after the forward and
backward passes (and after each evaluation step), level 2 also after the optimizer step. The
allocator is the run's device's (``torch.<device type>.empty_cache``); the CPU allocator keeps no
cache, so on CPU ranks the flag has nothing to release.
"""

import gc

import torch


class ManualGC:
    """Owns the collector for the duration of a training loop (a context manager)."""

    def __init__(self, enabled: bool, interval: int, around_eval: bool = True):
        self.enabled, self.interval = enabled, interval
        self.around_eval = enabled and around_eval
        self._was_enabled = gc.isenabled()

    def __enter__(self):
        if self.enabled:
            gc.disable()
            gc.collect()
        return self

    def __exit__(self, *exc):
        if self.enabled and self._was_enabled:
            gc.enable()

    def after_step(self, iteration: int) -> None:
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    def before_eval(self) -> None:
        if self.around_eval:
            gc.collect()  # all generations

    def after_eval(self) -> None:
        if self.around_eval:
            gc.collect(generation=0)  # only the young objects evaluation made and dropped


def empty_cache(level: int, at_least: int, device: torch.device) -> None:
    """Release cached device memory when --empty-unused-memory-level >= ``at_least``."""
    if level < at_least:
        return
    backend = getattr(torch, device.type, None)
    release = getattr(backend, "empty_cache", None)
    if release is not None:  # torch.cpu has none: the CPU allocator caches nothing
        release()
