# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""The torch_dist async writer's results queue lives in a multiprocessing Manager whose server
is a process in the rank's process group. torchrun and Slurm deliver SIGTERM to that whole group
(killpg) before the rank's --exit-signal-handler save, which then needs the queue: the server
must outlive the signal. Before the fix it died, and the save raised BrokenPipeError."""

import multiprocessing as mp
import os
import signal
import time

from megatron.core.dist_checkpointing.strategies import filesystem_async


def test_results_queue_survives_a_sigterm_to_the_process_group():
    saved, filesystem_async._results_queue = filesystem_async._results_queue, None
    try:
        before = {p.pid for p in mp.active_children()}
        queue = filesystem_async.get_write_results_queue("spawn")
        servers = [p for p in mp.active_children() if p.pid not in before]
        assert len(servers) == 1
        os.kill(servers[0].pid, signal.SIGTERM)  # what the job's killpg delivers to it
        time.sleep(1.0)
        assert servers[0].is_alive()
        queue.put("written")  # before the fix: BrokenPipeError / EOFError
        assert queue.get(timeout=10) == "written"
    finally:
        filesystem_async._results_queue = saved
