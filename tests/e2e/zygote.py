"""A pre-imported launcher for the end-to-end tests: ``pretrain_gpt.py`` runs in forked copies of
one interpreter that has imported it once.

Each launch of the real program starts fresh interpreters (torchrun's launcher plus one per rank)
that import torch and megatron-core: about 4 s of CPU per process, most of a tiny test run. This
server imports ``pretrain_gpt`` once; per launch it forks one process per rank, which sets the
environment a launch would have (torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``; none of them for one plain process), points stdout/stderr at
the launch's output files and runs ``pretrain_gpt.main(argv)`` as ``python pretrain_gpt.py``
would, exit code included. The server never initializes torch's devices or threads, so a fork is
a clean start. Like torchrun, a launch whose rank fails exits 1 once every rank has ended (ranks
left running after a failure are killed after ``GRACE_S``). Tests about torchrun itself (signals,
how it stops the other ranks) use the real launcher (``cli.run(..., torchrun=True)``).

Protocol: one JSON request per line on stdin ({argv, nproc, env, cwd, out, err, timeout}), one
JSON reply per line on the original stdout ({"code": int} or {"timeout": true}).
"""

import atexit
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback

GRACE_S = 60  # after one rank failed, the others' time to stop on their own (failures.py)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_env(env: dict, rank: int, nproc: int, port: int) -> dict:
    if nproc == 1:  # `python pretrain_gpt.py`: no launcher variables
        return env
    return dict(
        env,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _run_rank(request: dict, env: dict) -> None:
    """In the forked child: become the launched program, then exit with its code."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    for fd, path in ((1, request["out"]), (2, request["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
    sys.argv = ["pretrain_gpt.py", *request["argv"]]
    code = 1
    try:
        import writer_queue

        import pretrain_gpt

        writer_queue.install()  # torch_dist saves: a forked queue server (tests/writer_queue.py)

        code = pretrain_gpt.main(request["argv"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # an uncaught error: the interpreter's traceback and exit code 1
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # what interpreter exit runs (os._exit skips it)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def _threads() -> int:
    """Threads of this process, native ones (OpenMP, tokenizer pools) included where Linux
    lists them."""
    task = "/proc/self/task"
    return len(os.listdir(task)) if os.path.isdir(task) else threading.active_count()


def _start(request: dict, reply) -> list:
    threads = _threads()
    if threads != 1:  # a fork copies only the forking thread: others' locks would stay held
        raise RuntimeError(f"zygote: {threads - 1} more threads alive at fork time")
    port = _free_port()
    pids = []
    for rank in range(request["nproc"]):
        env = _rank_env(request["env"], rank, request["nproc"], port)
        pid = os.fork()
        if pid == 0:
            reply.close()
            _run_rank(request, env)
        pids.append(pid)
    return pids


def _wait(pids: list, timeout: float) -> tuple:
    """Reap every rank: ([exit code per rank], timed out); after a deadline or a failure's
    grace period the ranks still running are killed."""
    codes, deadline, failed_at, timed_out = {}, time.monotonic() + timeout, None, False
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        now = time.monotonic()
        if failed_at is None and any(codes.values()):
            failed_at = now
        timed_out = timed_out or now > deadline
        if timed_out or (failed_at is not None and now > failed_at + GRACE_S):
            _kill([p for p in pids if p not in codes], codes)
        time.sleep(0.02)
    return [codes[p] for p in pids], timed_out


def _kill(pids: list, codes: dict) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        codes[pid] = -signal.SIGKILL


def serve() -> None:
    reply = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nothing of the server's own reaches a launch's output
    sys.path.insert(0, os.getcwd())
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
    import torch
    import torch._dynamo  # noqa: F401  (torch.optim imports it at the first optimizer: ~0.8 s)

    import pretrain_gpt  # noqa: F401  (the one import every launch reuses)

    if torch.cuda.is_initialized():  # forked ranks could not use the device
        raise RuntimeError("zygote: importing pretrain_gpt initialized CUDA; use E2E_REAL_LAUNCH=1")

    for line in sys.stdin:
        request = json.loads(line)
        pids = _start(request, reply)
        codes, timed_out = _wait(pids, request["timeout"])
        code = next((c for c in codes if c), 0)
        if request["nproc"] > 1 and code:
            code = 1  # torchrun's exit code when a rank failed
        reply.write(json.dumps({"timeout": True} if timed_out else {"code": code}) + "\n")
        reply.flush()


if __name__ == "__main__":
    serve()
