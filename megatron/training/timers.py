"""Named timers with Megatron-LM's interface and report formats, on any device.

    timers = Timers(log_level=1, log_option="minmax", device=device)
    timers("optimizer", log_level=1).start(barrier=False); ...; timers("optimizer").stop()

megatron-core calls the same interface through ``TransformerConfig.timers`` (pipeline schedules:
``forward-backward``, ``forward-compute``, p2p; ``finalize_model_grads``: ``all-grads-sync``)
and ``OptimizerConfig.timers`` (``optimizer-inner-step``, ``optimizer-clip-main-grad``, ...; Muon:
``muon-newton-schulz``, ``muon-dp-exchange``). A timer whose level is above ``--timing-log-level``
is a no-op, so that finer timers cost nothing unless asked for.

Why a device sync: on an asynchronous device (CUDA) a kernel launch returns before the work is
done; a timer reads the clock after ``synchronize`` so it measures the work, as Megatron-LM's
timers do. The CPU runs ops synchronously: there is nothing to wait for, and no call is made.

Reports (``--timing-log-option``): ``max`` and ``minmax`` over the ranks that ran the timer
(a rank that never started it reports 0 and is left out, as upstream), ``all`` per rank; one
all-gather over the world at each report, which every rank must join.
"""

import contextlib
import time
from typing import Optional

import torch

LEVELS = (0, 1, 2)
OPTIONS = ("max", "minmax", "all")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work; nothing on devices that run synchronously (CPU)."""
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    sync = getattr(backend, "synchronize", None)
    if sync is not None:
        sync(device)


class Timer:
    """Accumulates seconds between ``start`` and ``stop`` until ``elapsed(reset=True)``."""

    def __init__(self, name: str, device: torch.device, barrier_group=None):
        self.name, self.device, self.barrier_group = name, device, barrier_group
        self.seconds = 0.0
        self._started_at: Optional[float] = None

    def _barrier_and_sync(self, barrier: bool) -> None:
        if barrier:
            torch.distributed.barrier(group=self.barrier_group)
        synchronize(self.device)

    def start(self, barrier: bool = False) -> None:
        assert self._started_at is None, f"timer {self.name} has already been started"
        self._barrier_and_sync(barrier)
        self._started_at = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        assert self._started_at is not None, f"timer {self.name} is not started"
        self._barrier_and_sync(barrier)
        self.seconds += time.perf_counter() - self._started_at
        self._started_at = None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds so far (a running timer counts up to now and keeps running)."""
        running = self._started_at is not None
        if running:
            self.stop()
        seconds = self.seconds
        if reset:
            self.seconds = 0.0
        if running:
            self.start()
        return seconds


class _Off:
    """A timer above the log level: every call does nothing."""

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


_OFF = _Off()


class Timers:
    """The group of named timers (Megatron-LM's ``Timers``): levels 0-2, reports across ranks.

    ``always`` names timers that run whatever the level (e.g. Muon's, for --log-muon-figures).
    """

    def __init__(self, log_level: int, log_option: str, device: torch.device, always=()):
        if log_level not in LEVELS:
            raise ValueError(f"--timing-log-level must be one of {LEVELS}, got {log_level}")
        if log_option not in OPTIONS:
            raise ValueError(f"--timing-log-option must be one of {OPTIONS}, got {log_option!r}")
        self.log_level, self.log_option, self.device = log_level, log_option, device
        self.always = frozenset(always)
        self._timers: dict[str, Timer] = {}
        self._levels: dict[str, int] = {}

    def __call__(self, name: str, log_level: Optional[int] = None):
        """The timer ``name``; its level is fixed by the first call (unset: the finest, 2)."""
        if name in self._levels:
            assert log_level in (None, self._levels[name]), (
                f"timer {name}: log level {log_level}, registered with {self._levels[name]}"
            )
        else:
            self._levels[name] = max(LEVELS) if log_level is None else log_level
        if self._levels[name] > self.log_level and name not in self.always:
            return _OFF
        if name not in self._timers:
            self._timers[name] = Timer(name, self.device)
        return self._timers[name]

    def active(self, names) -> list:
        """The names among ``names`` that run at this level (the ones worth reporting)."""
        return [n for n in names if n in self.always or self._level_of(n) <= self.log_level]

    def _level_of(self, name: str) -> int:
        return self._levels.get(name, max(LEVELS))

    def seconds_per_rank(self, names: list, reset: bool = True) -> torch.Tensor:
        """[world, len(names)] seconds of every rank (0 where a rank never ran the timer).
        A collective over the world: every rank calls it with the same names."""
        if not names:  # the same on every rank: all of them skip the collective
            return torch.zeros(torch.distributed.get_world_size(), 0, dtype=torch.float64)
        local = [self._timers[n].elapsed(reset) if n in self._timers else 0.0 for n in names]
        return gather_per_rank(local, self.device)

    def format(self, names: list, ms_per_rank: torch.Tensor) -> Optional[str]:
        """Megatron-LM's text for ``--timing-log-option`` from ``seconds_per_rank`` in ms (per
        iteration, as the caller normalized it); None when no rank ran any of them."""
        if self.log_option == "all":
            return _all_ranks_text(names, ms_per_rank)
        return _min_max_text(names, ms_per_rank, max_only=self.log_option == "max")


def started(timers, name: str, log_level: int, barrier: bool = False):
    """``timers(name, log_level)`` started (a no-op timer without timers or above the level)."""
    timer = timers(name, log_level=log_level) if timers is not None else _OFF
    timer.start(barrier=barrier)
    return timer


@contextlib.contextmanager
def suspended(config):
    """No timers in ``config`` (megatron-core's) for the block, as Megatron-LM's evaluation:
    its forward passes must not add to the training step's ``forward-backward`` time."""
    timers, config.timers = config.timers, None
    try:
        yield
    finally:
        config.timers = timers


def gather_per_rank(values: list, device: torch.device) -> torch.Tensor:
    """[world, len(values)] float64: every rank's ``values`` on every rank (one all-gather)."""
    local = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, local)
    return torch.stack(out).cpu()


def min_max(per_rank: torch.Tensor, column: int) -> Optional[tuple]:
    """(min, max) over the ranks with a positive value (those that ran the timer), or None."""
    ran = [v for v in per_rank[:, column].tolist() if v > 0.0]
    return (min(ran), max(ran)) if ran else None


def _min_max_text(names, per_rank, max_only: bool) -> Optional[str]:
    lines = []
    for i, name in enumerate(names):
        found = min_max(per_rank, i)
        if found is None:
            continue
        label = (name + " ").ljust(48, ".")
        value = f"{found[1]:.2f}" if max_only else f"({found[0]:.2f}, {found[1]:.2f})"
        lines.append(f"    {label}: {value}")
    if not lines:
        return None
    head = "max time across ranks (ms):" if max_only else "(min, max) time across ranks (ms):"
    return "\n".join([head, *lines])


def _all_ranks_text(names, per_rank) -> Optional[str]:
    lines = []
    for i, name in enumerate(names):
        ranks = [(r, v) for r, v in enumerate(per_rank[:, i].tolist()) if v > 0.0]
        if ranks:
            lines.append(f"  {name}:")
            lines += [f"     rank {r:2d}: {v:.2f}" for r, v in ranks]
    return "\n".join(["times across ranks (ms):", *lines]) if lines else None
