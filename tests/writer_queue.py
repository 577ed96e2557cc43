"""The torch_dist writer's results queue from a fork, for ranks forked from a process that has
imported torch (harness.run_distributed's ranks, tests/e2e/zygote.py's launches).

Upstream's ``filesystem_async.get_write_results_queue`` (0.16.1: ``_get_write_results_queue``)
starts a spawn-context Manager once per process; its server imports torch (~1.7 s of CPU) to
unpickle the first save's write results.
A test rank pays that on its first torch_dist save, as every real rank does once per run, and
the suite runs hundreds of short-lived ranks. A fork-context Manager's server starts with torch
already imported; it is the same queue (a Manager's, which the writer's forked processes share),
started the way upstream starts the writer processes themselves (fork). Only the start method
differs: a launch with ``E2E_REAL_LAUNCH=1`` runs upstream's as it is.
"""

import multiprocessing


def _results_queue_from_a_fork(mp_mode: str = "spawn"):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        manager = multiprocessing.get_context("fork").Manager()
        filesystem_async._results_queue = manager.Queue()
    return filesystem_async._results_queue


def install() -> None:
    """In this process, the first torch_dist save starts its results queue by fork."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # 0.16.1: _get_write_results_queue (public, with an mp_mode argument, since 0.17)
    name = "get_write_results_queue"
    name = name if hasattr(filesystem_async, name) else "_" + name
    assert hasattr(filesystem_async, name), "upstream's writer queue moved: re-point this hook"
    setattr(filesystem_async, name, _results_queue_from_a_fork)
