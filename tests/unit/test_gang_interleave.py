"""The gang blocks' interleaving (planner/gangs.py, ``GangRunner._interleave``, and its window as
tp.py's ``stream`` uses it: ``newton_schulz.interleave``) without ranks: the order requests are
posted and waited in, and errors that surface at once."""

import pytest
import torch

from megatron.core.optimizer.megatron_muon.newton_schulz import SUM
from megatron.core.optimizer.megatron_muon.planner.gangs import GangRunner, Posted


def _unit(name: str, requests: int, log: list):
    """A unit that posts ``requests`` sums, logging each step it computes."""
    for j in range(requests):
        log.append(("compute", name, j))
        yield SUM, torch.tensor([float(j)])
    log.append(("compute", name, requests))
    return name


class _Work:
    """A posted collective's work: logs its wait, or raises ``error`` there."""

    def __init__(self, log: list, name: str, j: int, error=None):
        self.log, self.name, self.j, self.error = log, name, j, error

    def wait(self):
        if self.error is not None:
            raise self.error
        self.log.append(("wait", self.name, self.j))


def _posting(name: str, log: list, members=(0, 1), error=None):
    def post(t):
        log.append(("post", name, int(t.item())))
        return Posted(_Work(log, name, int(t.item()), error), None, t, members)

    return post


def _runner() -> GangRunner:
    return GangRunner(None)


def test_units_run_in_rounds_and_requests_are_posted_in_one_order():
    """Round j: each unit still running waits for its request j - 1, computes, posts request j:
    posts in (round, unit order), the order every gang member uses, so collectives of different
    gangs never wait on each other in a circle."""
    log: list = []
    steps = [_unit("a", 3, log), _unit("b", 1, log), _unit("c", 2, log)]
    serve = [{SUM: _posting(n, log)} for n in "abc"]
    out = _runner()._interleave(steps, serve, [(0, 1), (0, 2), (0, 3)])
    assert out == ["a", "b", "c"]
    order = [(name, j) for kind, name, j in log if kind == "post"]
    assert order == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("c", 1), ("a", 2)]
    # a unit's step j + 1 runs only after its request j was waited for; every post is waited for
    for kind, name, j in log:
        if kind == "compute" and j:
            assert log.index(("wait", name, j - 1)) < log.index((kind, name, j))
        if kind == "post":
            assert ("wait", name, j) in log


def test_an_error_on_the_main_thread_surfaces_while_a_collective_is_still_posted():
    """A unit that fails while another's posted collective is not done: nothing waits for it,
    the error is raised at once (its peers still complete it: docs/gangs.md)."""
    log: list = []

    def failing():
        raise RuntimeError("out of memory")
        yield  # a generator function

    steps = [_unit("a", 1, log), failing()]
    with pytest.raises(RuntimeError, match="out of memory"):
        _runner()._interleave(steps, [{SUM: _posting("a", log)}, {}], [(0, 1), (0, 2)])
    assert ("post", "a", 0) in log and ("wait", "a", 0) not in log


def test_an_error_in_a_collective_surfaces_on_the_main_thread():
    serve = [{SUM: _posting("a", [], error=ConnectionError("peer gone"))}]
    with pytest.raises(ConnectionError, match="peer gone"):
        _runner()._interleave([_unit("a", 2, [])], serve, [(0, 1)])


def test_a_window_keeps_that_many_running_and_the_next_takes_a_finished_ones_turn():
    """``newton_schulz.interleave`` with a window of 2 (tp.py's ``stream``): a and b run; when b
    ends, c starts at once in b's turn; a generator is not started before a place is free."""
    from megatron.core.optimizer.megatron_muon.newton_schulz import interleave

    log: list = []
    steps = [_unit("a", 3, log), _unit("b", 1, log), _unit("c", 2, log)]

    def post(i, kind, t):
        name = "abc"[i]
        log.append(("post", name, int(t.item())))
        return _Work(log, name, int(t.item()))

    out = interleave(steps, post, lambda work: work.wait(), window=2)
    assert out == ["a", "b", "c"]
    order = [(name, j) for kind, name, j in log if kind == "post"]
    assert order == [("a", 0), ("b", 0), ("a", 1), ("c", 0), ("a", 2), ("c", 1)]
    assert log.index(("compute", "c", 0)) > log.index(("compute", "b", 1))  # b ended first
    assert all(("wait", n, j) in log for kind, n, j in log if kind == "post")
