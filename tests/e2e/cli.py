"""Drive the real CLI (pretrain_gpt.py, tools/preprocess_data.py) in subprocesses on CPU.

One rank runs ``python pretrain_gpt.py``; several run under ``python -m torch.distributed.run
--standalone`` as users launch them. Ranks get OMP_NUM_THREADS=1: they share the cores.

``run`` hands launches to ``zygote.py`` (forks of one interpreter that imported pretrain_gpt
once, with the environment, output and exit code of those launches) unless the test is about
the launcher itself (``torchrun=True``; ``start`` always launches for real) or
``E2E_REAL_LAUNCH=1`` asks for real launches throughout."""

import atexit
import json
import os
import re
import select
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --mock-data --vocab-size 64 "
    "--log-interval 1 --eval-interval 2 --eval-iters 1 --num-workers 0"
).split()

_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|.*?grad norm: (\S+) \|")


def command(args, nproc: int = 1) -> tuple[list, dict]:
    """(argv, environment) of one launch."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("WORLD_SIZE", None)
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone"]
    return launcher + [os.path.join(ROOT, "pretrain_gpt.py"), *map(str, args)], env


def run(args, nproc: int = 1, timeout: int = 300, torchrun=False) -> subprocess.CompletedProcess:
    cmd, env = command(args, nproc)
    if torchrun or os.environ.get("E2E_REAL_LAUNCH") == "1":
        return subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    return _zygote_run(cmd, [str(a) for a in args], nproc, env, timeout)


_ZYGOTE: list = []  # the server process, started on first use


def _zygote() -> subprocess.Popen:
    if not _ZYGOTE or _ZYGOTE[0].poll() is not None:
        _, env = command([])
        server = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "e2e", "zygote.py")],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        atexit.register(_stop, server)
        _ZYGOTE[:] = [server]
    return _ZYGOTE[0]


def _stop(server: subprocess.Popen) -> None:
    """End of input ends the server; waiting for it lets its ranks' CPU time count as ours."""
    server.stdin.close()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _zygote_run(cmd, argv, nproc, env, timeout) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        request = dict(argv=argv, nproc=nproc, env=env, cwd=ROOT, out=out, err=err)
        server = _zygote()
        server.stdin.write(json.dumps(dict(request, timeout=timeout)) + "\n")
        server.stdin.flush()
        ready, _, _ = select.select([server.stdout], [], [], timeout + 30)
        reply = json.loads(server.stdout.readline() or "{}") if ready else {}
        stdout, stderr = _read(out), _read(err)
    if not reply and server.poll() is not None:
        raise RuntimeError(f"the e2e launcher (tests/e2e/zygote.py) exited ({server.returncode})")
    if "code" not in reply:  # the server's own deadline passed (or it hangs): start afresh
        if not reply.get("timeout"):
            server.kill()
            _ZYGOTE.clear()
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, reply["code"], stdout, stderr)


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def start(args, nproc: int = 1) -> subprocess.Popen:
    """A launch whose output is read while it runs (stderr merged into stdout)."""
    cmd, env = command(args, nproc)
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def losses(proc: subprocess.CompletedProcess) -> dict:
    """{iteration: (lm loss, grad norm)} as printed (6 significant digits / 3 decimals)."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {int(m[1]): (m[2], m[3]) for m in _LINE.finditer(proc.stdout)}


def floats(table: dict) -> list:
    return [float(table[i][0]) for i in sorted(table)]
