"""When to stop training early, as Megatron-LM: --exit-signal-handler, --exit-duration-in-mins,
--exit-interval. The loop saves a checkpoint and the process exits 0, so that a requeued job
(Slurm sends SIGTERM before a time limit or a preemption) resumes from it.

    stop = ExitConditions(args, start_time)   # installs the signal handler at start-up
    reason = stop.check(iteration)             # after each step; same answer on every rank

Ranks agree collectively: one all-reduce (MAX) of [signal seen, time is up] per step, so a signal
that reached one rank (or reached ranks in different steps) stops every rank after the same step;
nobody is left waiting in a collective. The all-reduce runs only when a flag asks for it.
"""

import signal
import time

import torch


def parse_signal(text: str) -> signal.Signals:
    """--exit-signal: a name (SIGTERM, TERM, sigusr1) or a number (15)."""
    name = text.strip().upper()
    if name.isdigit():
        return signal.Signals(int(name))
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError:
        raise ValueError(f"unknown signal {text!r}; e.g. SIGTERM, SIGUSR1 or 15") from None


class SignalFlag:
    """Records that a signal arrived; the loop polls it (handlers must not do collectives)."""

    def __init__(self, sig: signal.Signals):
        self.sig = sig
        self.received = False
        self._previous = signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.received = True

    def release(self) -> None:
        signal.signal(self.sig, self._previous)


class ExitConditions:
    """The early-exit flags of one run; ``check`` returns why to stop, or None."""

    def __init__(self, args, start_time: float):
        self.start_time = start_time
        self.minutes = args.exit_duration_in_mins
        self.interval = args.exit_interval
        self.signal = SignalFlag(args.exit_signal) if args.exit_signal_handler else None

    def check(self, iteration: int, device=None) -> str | None:
        """Collective when --exit-signal-handler or --exit-duration-in-mins is set: every rank
        must call it after every step."""
        if self.signal is not None or self.minutes is not None:
            got_signal, time_up = self._agree(device)
            if got_signal:
                return f"exiting program after receiving {self.signal.sig.name}"
            if time_up:
                return f"exiting program after {self.elapsed_minutes():.2f} minutes"
        if self.interval and iteration % self.interval == 0:
            return f"exiting program at iteration {iteration}"
        return None

    def time_up(self, device=None) -> bool:
        """--exit-duration-in-mins is over on some rank (collective when it is set; Megatron-LM
        asks after every evaluation batch)."""
        if self.minutes is None:
            return False
        flag = torch.tensor([int(self._past_limit())], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def elapsed_minutes(self) -> float:
        return (time.time() - self.start_time) / 60.0

    def _past_limit(self) -> bool:
        return self.minutes is not None and self.elapsed_minutes() > self.minutes

    def _agree(self, device) -> tuple[bool, bool]:
        local = [
            self.signal is not None and self.signal.received,
            self._past_limit(),
        ]
        flags = torch.tensor(local, dtype=torch.int32, device=device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def release(self) -> None:
        if self.signal is not None:
            self.signal.release()
