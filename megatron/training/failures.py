"""Fail loudly, on every rank: a collective NaN/inf check and a failure broadcast.

``check_finite`` decides *collectively* (one all-reduce over all ranks) whether this step's loss
or gradients are non-finite, so every rank raises ``TrainingError`` at the same iteration, before
the optimizer step: NaN weights are never written, hence never saved as the latest checkpoint.

``FailureBroadcast`` is the entry point's answer to "one rank failed, the others wait in a
collective": the failing rank prints its own one-line error with its rank and publishes it in the
process group's key-value store (torchrun's agent store, or rank 0's TCPStore); a watchdog thread
on every other rank polls the store and, seeing the failure, prints one line naming the failed
rank and exits, instead of a gloo/NCCL transport traceback minutes later. The failing rank waits
(bounded) until the others have printed before it exits, so the launcher (which tears everyone
down when the first worker exits) reports it as the first failure.
"""

import os
import sys
import threading
import time
import traceback

import torch

FAILED_KEY = "megatron_muon/failed"  # "<rank>\n<one-line message>" of the first failure
DONE_KEY = "megatron_muon/done"  # ranks that printed their line (failed or acknowledged)


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a NaN loss); every rank raises it at the same iteration."""


# ------------------------------------------------------------------------ NaN / inf check


def local_nonfinite(outputs: list, grad_buffers: list) -> tuple[bool, bool]:
    """(loss, grads) non-finite on this rank: the last stage's per-micro-batch loss reports and
    the gradient buffers (with DistOpt a reduce-scattered shard plus local, unreduced grads:
    a NaN produced on any DP rank shows in one of them)."""
    bad_loss = any(not torch.isfinite(v).all() for out in outputs for v in out.values())
    bad_grad = any(not torch.isfinite(buf).all() for buf in grad_buffers)
    return bool(bad_loss), bool(bad_grad)


def check_finite(outputs: list, grad_buffers: list, iteration: int, device) -> None:
    """Raise TrainingError on every rank if any rank's loss or grads are NaN/inf (collective)."""
    loss, grads = local_nonfinite(outputs, grad_buffers)
    flags = torch.tensor([int(loss), int(grads)], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    loss, grads = bool(flags[0].item()), bool(flags[1].item())
    if loss or grads:
        what = " and ".join(n for n, bad in (("loss", loss), ("gradients", grads)) if bad)
        raise TrainingError(
            f"NaN or inf in the {what} at iteration {iteration}: training stopped before the "
            "optimizer step, nothing of this iteration was applied or saved (lower --lr, check "
            "the data; --no-check-for-nan-in-loss-and-grad disables this check)"
        )


def model_grad_buffers(model) -> list:
    """The gradient buffers of DDP-wrapped model chunks (dense and expert)."""
    buffers = []
    for chunk in model:
        for buf in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
            buffers.append(buf.grad_data)
    return buffers


# ------------------------------------------------------------------------ failure broadcast


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


class FailureBroadcast:
    """Per-process guard: ``start()`` after the process group exists, ``fail(message)`` on an
    error, ``stop()`` before a clean shutdown. Without a process group (or with one rank) it
    only prints."""

    def __init__(self, prog: str, poll_s: float | None = None, wait_s: float = 10.0):
        self.prog, self._poll_s, self.wait_s = prog, poll_s, wait_s
        self.rank, self.world, self.store = 0, 1, None
        self._stop = threading.Event()
        self._failed = threading.Event()
        self._lock = threading.Lock()
        self._printed = False
        self._thread = None

    def start(self) -> "FailureBroadcast":
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            from torch.distributed.distributed_c10d import _get_default_store

            self.rank = torch.distributed.get_rank()
            self.world = torch.distributed.get_world_size()
            self.store = _get_default_store()
            # one store request per rank per poll: ~500 requests/s at most on the store's host
            self.poll_s = self._poll_s or max(0.5, self.world / 500)
            self._thread = threading.Thread(target=self._watch, name="failure-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def where(self) -> str:
        return f"{self.prog}: rank {self.rank}" if self.world > 1 else self.prog

    # ---------------------------------------------------------------- the failing rank
    def fail_with(self, err: BaseException, label: str = "error", expected: bool = True) -> None:
        """Report an exception. Ours (``expected``) print one line; a bug also its traceback;
        a transport error after another rank's published failure is its echo: one line naming
        that rank instead."""
        self._failed.set()
        first = self.peer_failure()
        if first is not None and (not expected or self._is_transport_error(one_line(err))):
            self._acknowledge(first)
            self.stop()
            return
        if not expected:
            traceback.print_exc()
        self.fail(f"{label}: {one_line(err)}")

    def fail(self, message: str) -> None:
        """Print this rank's error, publish it and wait until every rank printed its line
        (bounded by ``wait_s``)."""
        self._failed.set()
        with self._lock:
            self._printed = True
        _print(f"{self.where()}: {message}")
        self._publish(message)
        self._done()
        self._wait_for_everyone()
        self.stop()

    def _acknowledge(self, first: str) -> bool:
        """Print "stopping: rank R failed" once per process (watchdog or main thread)."""
        with self._lock:
            if self._printed:
                return False
            self._printed = True
        _print(f"{self.where()}: stopping: {first}")
        self._done()
        return True

    def _publish(self, message: str) -> None:
        if self.store is None:
            return
        try:
            self.store.compare_set(FAILED_KEY, "", f"{self.rank}\n{message}")
        except Exception:  # the store's host is gone: nobody is left to tell
            pass

    def _done(self) -> None:
        if self.store is not None:
            try:
                self.store.add(DONE_KEY, 1)
            except Exception:
                pass

    def _wait_for_everyone(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while self.store is not None and time.monotonic() < deadline:
            try:
                if self.store.add(DONE_KEY, 0) >= self.world:
                    return
            except Exception:
                return
            time.sleep(0.05)

    @staticmethod
    def _is_transport_error(message: str) -> bool:
        words = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Gloo")
        return any(word in message for word in words)

    # ---------------------------------------------------------------- everyone else
    def peer_failure(self):
        """ "rank R failed: ..." if another rank published a failure, else None."""
        if self.store is None:
            return None
        try:
            if not self.store.check([FAILED_KEY]):
                return None
            rank, message = self.store.get(FAILED_KEY).decode().split("\n", 1)
        except Exception:
            return None
        return None if int(rank) == self.rank else f"rank {rank} failed: {message}"

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self._failed.is_set():
                return
            first = self.peer_failure()
            if first is None or not self._acknowledge(first):
                continue
            # let the failed rank exit first: launchers name the first exit as the root cause
            self._stop.wait(1.0)
            self.exit(1)

    exit = staticmethod(os._exit)  # no cleanup: the main thread may be inside a collective


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
