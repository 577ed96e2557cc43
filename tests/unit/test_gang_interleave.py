"""The gang blocks' interleaving (planner/gangs.py, ``GangRunner._interleave``) without
ranks:
the order the communication thread serves requests in, and errors that surface at once."""

import subprocess
import sys
import threading

import pytest
import torch

from megatron.core.optimizer.megatron_muon.newton_schulz import SUM
from megatron.core.optimizer.megatron_muon.planner.gangs import GangRunner


def _unit(name: str, requests: int, log: list):
    """A unit that posts ``requests`` sums, logging each step it computes."""
    for j in range(requests):
        log.append(("compute", name, j))
        yield SUM, torch.tensor([float(j)])
    log.append(("compute", name, requests))
    return name


def _orthogonalizer() -> GangRunner:
    return GangRunner(None, device=torch.device("cpu"))


def test_units_run_in_rounds_and_requests_are_served_in_one_order():
    """Round j: each unit still running waits for its request j - 1, computes, posts request j;
    the thread serves posts in post order: (round, unit order), the order every gang member
    uses, so rings of different gangs never wait on each other in a circle."""
    log: list = []
    served = lambda name: lambda t: log.append(("serve", name, int(t.item())))  # noqa: E731
    steps = [_unit("a", 3, log), _unit("b", 1, log), _unit("c", 2, log)]
    serve = [{SUM: served(n)} for n in "abc"]
    out = _orthogonalizer()._interleave(steps, serve, [(0, 1), (0, 2), (0, 3)])
    assert out == ["a", "b", "c"]
    order = [(name, j) for kind, name, j in log if kind == "serve"]
    assert order == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2)]
    # a unit's step j + 1 runs only after its request j was served
    for kind, name, j in log:
        if kind == "compute" and j:
            assert log.index(("serve", name, j - 1)) < log.index((kind, name, j))
    assert not [t for t in threading.enumerate() if t.name.startswith("muon-gang")]


def test_an_error_on_the_main_thread_surfaces_while_a_collective_still_waits():
    """A unit that fails while another's collective waits for peers that never come: the error
    is raised at once (joining the communication thread would hang and hide it)."""
    release = threading.Event()

    def failing():
        raise RuntimeError("out of memory")
        yield  # a generator function

    steps = [_unit("a", 1, []), failing()]
    serve = [{SUM: lambda t: release.wait(60)}, {}]
    result: list = []

    def run():
        try:
            _orthogonalizer()._interleave(steps, serve, [(0, 1), (0, 2)])
        except RuntimeError as err:
            result.append(err)

    caller = threading.Thread(target=run)
    caller.start()
    caller.join(timeout=20)
    release.set()  # let the communication thread end
    assert not caller.is_alive(), "the error waited for the blocked collective"
    assert result and "out of memory" in str(result[0])


def test_an_error_in_a_collective_surfaces_on_the_main_thread():
    def broken(t):
        raise ConnectionError("peer gone")

    with pytest.raises(ConnectionError, match="peer gone"):
        _orthogonalizer()._interleave([_unit("a", 2, [])], [{SUM: broken}], [(0, 1)])


_BLOCKED_AT_EXIT = """
import subprocess
import sys
import threading
import torch
from megatron.core.optimizer.megatron_muon.planner.gangs import GangRunner
from megatron.core.optimizer.megatron_muon.newton_schulz import SUM

def unit():
    yield SUM, torch.zeros(1)

def failing():
    raise RuntimeError("out of memory")
    yield

peers = threading.Event()  # the peers of the posted sum never come
ortho = GangRunner(None, device=torch.device("cpu"))
try:
    ortho._interleave([unit(), failing()], [{SUM: lambda t: peers.wait()}, {}], [(0, 1), (0, 2)])
finally:
    print("raised", flush=True)
"""


def test_a_rank_whose_main_thread_fails_exits_while_a_collective_still_waits():
    """The process whose main thread raised while its communication thread waits for peers that
    never come (they failed too, or wait elsewhere) must exit with the error, not hang: the
    thread is a daemon (``CommThread``; a ``ThreadPoolExecutor`` worker, as before, is joined at
    exit and the process hangs: found by review, this test's first version failed on it)."""
    child = subprocess.Popen(
        [sys.executable, "-c", _BLOCKED_AT_EXIT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "raised"
        # a hang never ends; an exit can take ~10 s on a loaded machine (base 0.19.2's import
        # of emerging_optimizers pulls in torch._inductor, whose exit was measured at 8-10 s)
        rc = child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    assert rc not in (None, 0), "the process did not exit after the error"
