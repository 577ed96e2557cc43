"""Run a function on N gloo ranks with a (TP, PP, EP) layout; DP is what remains.

    results = run_distributed(fn, world_size=8, tp=2, pp=2, args=(cfg,))

Ranks are *forked* from the test process after its imports (about 0.6 s for 8 ranks on 2 cores,
against ~21 s for spawn, which re-imports torch and megatron in every rank). Each rank sets one
intra-op thread first: forked children must not touch the parent's OpenMP pool, and 8 ranks on 2
cores gain nothing from more. A failure in any rank is raised in the test with that rank's
traceback; the other ranks (likely blocked in a collective) are killed, and a run that exceeds
``timeout`` seconds is killed and reported with the ranks that never answered: no hangs. A rank
killed by a signal (a native crash) prints every thread's native and Python stack, and is named
as the root cause ahead of the peers' transport errors.
"""

import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass


class RankFailure(AssertionError):
    """A rank raised, or ranks did not finish in time; the message carries their tracebacks."""


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel size; None = same as tp
    vpp: int | None = None
    dp_instances: int = 1  # num_distributed_optimizer_instances: HSDP's outer (replica) groups

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


def _init_rank(rank: int, layout: Layout, store: str, seed: int) -> None:
    import datetime
    import os
    import warnings

    import torch

    _print_stacks_on_fatal_signals()
    # TEST_RANK_THREADS: another summation order for tools/parity_margins.py (default 1, above)
    torch.set_num_threads(int(os.environ.get("TEST_RANK_THREADS", "1")))
    # upstream's deprecation and CUDA-tuning warnings, once per rank, drown the tracebacks
    warnings.simplefilter("ignore")
    import writer_queue

    from megatron.core import parallel_state, tensor_parallel
    from megatron.training import cpu_mode

    cpu_mode.enable()
    writer_queue.install()  # torch_dist saves: upstream's spawned queue server would import torch
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"file://{store}",  # a file, not a port: no port another run can take
        rank=rank,
        world_size=layout.world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        num_distributed_optimizer_instances=layout.dp_instances,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _print_stacks_on_fatal_signals() -> None:
    """A rank killed by SIGSEGV/SIGABRT/SIGBUS prints every thread's stack to stderr (pytest
    shows it with the failure): native frames from c10's handler, which then chains to
    faulthandler's Python frames. Without this a native crash in a gloo thread left only the
    peers' "Connection reset by peer"."""
    import faulthandler

    import torch

    faulthandler.enable(all_threads=True)
    torch._C._set_print_stack_traces_on_fatal_signal(True)


def _native_threads() -> int:
    """Threads of this process, native ones included (Linux; 0 where /proc is absent)."""
    import os

    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _teardown_rank() -> None:
    import torch

    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _to_bytes(value) -> bytes:
    # Tensors would otherwise travel as shared-memory handles that die with the exiting rank.
    import io

    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _from_bytes(data: bytes):
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(rank, layout, store, seed, fn, args, kwargs, results):
    try:
        _init_rank(rank, layout, store, seed)
        out = fn(*args, **kwargs)
        results.put((rank, True, _to_bytes(out)))
        _teardown_rank()
    except BaseException:  # report everything, including SystemExit and asserts
        results.put((rank, False, traceback.format_exc()))
    finally:
        # Return instead of exiting: multiprocessing then runs its finalizers (e.g. it shuts
        # down the Manager process dist_checkpointing's async writer starts, which otherwise
        # outlives the rank) and exits with os._exit, skipping pytest's atexit handlers.
        results.close()
        results.join_thread()


def run_distributed(
    fn,
    world_size,
    *,
    tp=1,
    pp=1,
    ep=1,
    etp=None,
    vpp=None,
    dp_instances=1,
    args=(),
    kwargs=None,
    seed=1234,
    timeout=180.0,
):
    """Run ``fn(*args, **kwargs)`` on every rank; return the list of per-rank results."""
    layout = Layout(world_size, tp, pp, ep, etp, vpp, dp_instances)
    if world_size % (tp * pp):
        raise ValueError(f"world_size {world_size} is not divisible by tp*pp = {tp * pp}")
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    rendezvous = tempfile.mkdtemp(prefix="harness_store_")
    store = os.path.join(rendezvous, "store")
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, layout, store, seed, fn, args, kwargs or {}, results)
        )
        for r in range(world_size)
    ]
    # Forking copies only the calling thread; others (torch's intra-op pool, a leftover Python
    # thread) leave their locks behind in the child. Recorded for the report of a crashed rank.
    at_fork = f"{_native_threads()} threads ({threading.active_count()} Python) in the parent"
    with warnings.catch_warnings():
        _quiet_fork_warning()
        for p in procs:
            p.start()
    finished = False
    try:
        outputs = _collect(results, procs, world_size, timeout, at_fork)
        finished = True
        return outputs
    finally:
        for p in procs:
            # ranks that reported get a few seconds to exit cleanly (their finalizers stop
            # helper processes such as dist_checkpointing's Manager); the others are killed
            p.join(timeout=10 if finished else 0)
            if p.is_alive():
                p.kill()
            p.join()
        shutil.rmtree(rendezvous, ignore_errors=True)


def _quiet_fork_warning() -> None:
    """Python 3.12 warns at every fork from a process with threads ("use of fork() may lead to
    deadlocks"), one warning per rank: hundreds per suite. A test process always has some
    (measured: 2 under pytest before torch computes anything, 3 in an xdist worker, whose
    execnet reads its channel in a thread), so they cannot be avoided by forking earlier. The
    ranks touch none of their locks: each sets one intra-op thread before any torch op (never
    the parent's OpenMP pool) and starts gloo anew. The alternatives cost more than the risk:
    forkserver took 1.6x the wall time of test_harness.py + test_parity_adam.py (each rank
    imports its test module again) and loses a crashed rank's stacks (its stderr is the
    server's, not the test's); spawn re-imports torch and megatron in every rank (~21 s for 8)."""
    warnings.filterwarnings(
        "ignore", message=r"This process \(pid=\d+\) is multi-threaded", category=DeprecationWarning
    )


def _crashed(procs, grace: float) -> list:
    """Ranks killed by a signal, waiting up to ``grace`` seconds for the exit to show."""
    deadline = time.monotonic() + grace
    while True:
        crashed = [i for i, p in enumerate(procs) if (p.exitcode or 0) < 0]
        if crashed or time.monotonic() > deadline:
            return crashed
        time.sleep(0.05)


def _collect(results, procs, world_size, timeout, at_fork=""):
    outputs, deadline = {}, time.monotonic() + timeout
    while len(outputs) < world_size:
        try:
            rank, ok, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise RankFailure(
                    f"timeout after {timeout:.0f}s; ranks {missing} did not finish"
                ) from None
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                raise RankFailure(
                    f"ranks {dead} died without a report (exit {procs[dead[0]].exitcode}; a "
                    f"negative exit is a signal: its stacks are in the captured stderr; forked "
                    f"with {at_fork})"
                ) from None
            continue
        if not ok:
            crashed = _crashed(procs, grace=3.0)  # a peer's native crash is the root cause
            if crashed:
                raise RankFailure(
                    f"ranks {crashed} crashed (exit {procs[crashed[0]].exitcode}: a signal; "
                    f"stacks in the captured stderr; forked with {at_fork}); then rank {rank} "
                    f"of {world_size} failed:\n{value}"
                )
            raise RankFailure(f"rank {rank} of {world_size} failed:\n{value}")
        outputs[rank] = _from_bytes(value)
    return [outputs[r] for r in range(world_size)]
