"""Running gangs: a matrix split over several DP ranks, each orthogonalizing one block; the
gang's sums and gathers are point-to-point rings on a communication thread. docs/gangs.md.
"""

import functools
import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.distributed import P2POp

from ..exchange import Exchange
from ..functional import OrthoSpec, orthogonalize_sharded_steps
from ..newton_schulz import GATHER, SUM
from ..tp import TPOrthogonalizer, all_gather_ranges
from .cost_model import cut, node_layout, ring_traffic


class GangRunner:
    """Runs this rank's gang blocks of one exchange, all in flight together; ``sum_bytes``:
    the bytes its gang collectives moved."""

    def __init__(self, inner, device=None):
        self.inner = inner  # the TP orthogonalizer (``duplicated``: TP ranks share a block)
        self.device = device
        self.plan = None  # of the exchange being run
        self.sum_bytes = 0.0  # of the last ``run``
        self.streams: Optional[CommStreams] = None  # made at the first run

    def run(self, plan, ex: Exchange, gangs: list[int], blocks: list[Tensor], spec: OrthoSpec):
        """``s * NS`` of this rank's gang blocks, their collectives overlapping the others'
        matmuls (in the ``duplicated`` TP mode, TP-gathered all first).

        Args:
            plan: the ``MuonExchangePlan`` ``ex`` belongs to.
            ex: the exchange.
            gangs: the split matrices this rank holds a block of, in the plan's gang order.
            blocks: this rank's block of each, in the update dtype.
            spec: Newton-Schulz and scale settings.

        Returns:
            The orthogonalized, scaled blocks, in ``gangs`` order.
        """
        self.plan, self.sum_bytes = plan, 0.0
        slots = [self.plan.matrices[i] for i in gangs]
        units = [slot.unit_of(self.plan.rank) for slot in slots]

        def gang_fn(updates: list[Tensor], infos: list) -> list[Tensor]:
            steps, serve = [], []
            for u, info, unit in zip(updates, infos, units):
                members = unit.members
                part = (members.index(self.plan.rank), len(members)) if unit.splits else None
                steps.append(orthogonalize_sharded_steps(u, info, spec, unit.axis, True, part))
                tp = self._sharing(info)
                serve.append(
                    {
                        SUM: functools.partial(self._gang_sum, ex, members, tp),
                        GATHER: functools.partial(self._gang_gather, ex, members, tp),
                    }
                )
            return self._interleave(steps, serve, [unit.members for unit in units])

        infos = [slot.info for slot in slots]
        if isinstance(self.inner, TPOrthogonalizer):
            return self.inner.together(blocks, infos, gang_fn)
        return gang_fn(blocks, infos)

    def _interleave(self, steps: list, serve: list[dict], members: list[tuple]) -> list[Tensor]:
        """Run the generators ``steps`` in rounds, posting each request to the communication
        thread: one global order on every member, so no two gangs wait in a circle."""
        out: list = [None] * len(steps)
        pending: list = [None] * len(steps)
        live = list(range(len(steps)))
        if self.streams is None:
            self.streams = CommStreams.of(self.device)
        pool = CommThread(self.streams.enter)
        try:
            while live:
                for i in list(live):
                    if pending[i] is not None:
                        self._wait(pending[i])
                    try:
                        kind, t = next(steps[i]) if pending[i] is None else steps[i].send(None)
                    except StopIteration as done:
                        out[i] = done.value
                        live.remove(i)
                        continue
                    pending[i] = self._post(pool, serve[i][kind], t, members[i])
        except BaseException:
            # Raise now: a posted collective may wait for peers forever, and joining the
            # thread would hide the error behind a hang (it is a daemon: exit does not join it).
            pool.close(wait=False)
            raise
        pool.close(wait=True)
        return out

    def _post(self, pool, serve, t: Tensor, members: tuple) -> "_Posted":
        """Hand ``serve(t)`` (a gang collective over ``members``) to the communication thread."""
        return _Posted(pool.submit(self.streams.serve, serve, t, self.streams.ready()), t, members)

    def _wait(self, posted: "_Posted") -> None:
        """Wait until a posted collective is done (re-raising what it raised)."""
        self.streams.done(posted.future.result())

    def _sharing(self, info):
        """The TP group sharing the gathered block (``duplicated`` mode), each rank summing a
        slice over DP; else None."""
        inner = self.inner
        if isinstance(inner, TPOrthogonalizer) and inner.mode == "duplicated":
            return inner._group(info)
        return None

    def _gang_sum(self, ex: Exchange, members: tuple[int, ...], tp, t: Tensor) -> None:
        """``t`` summed in place over the gang (per TP slice where TP ranks share the block)."""
        flat = t.view(-1)
        lo, hi, slices, p = _tp_slice(flat.numel(), tp)
        nodes = self.plan.model.nodes
        node_all_reduce(flat[lo:hi], members, self.plan.rank, ex.group, nodes)
        if slices:
            all_gather_ranges(flat, slices, p, tp)
        moved = ring_traffic(hi - lo, t.element_size(), 2, node_layout(members, nodes))
        self.sum_bytes += 2 * sum(moved)

    def _gang_gather(self, ex: Exchange, members: tuple[int, ...], tp, poly: Tensor) -> None:
        """A split polynomial's rows gathered in place over the gang (across nodes: summed with
        the other rows zeroed, exact); per TP slice as ``_gang_sum``."""
        flat, cols = poly.view(-1), poly.shape[1]
        lo, hi, slices, p = _tp_slice(flat.numel(), tp)
        rows = [
            (min(max(a * cols, lo), hi), min(max(b * cols, lo), hi))
            for a, b in cut(poly.shape[0], len(members))
        ]
        nodes = self.plan.model.nodes
        m, n = node_layout(members, nodes)
        if m > 1 and n > 1:  # as a sum of zero-filled rows
            a, b = rows[members.index(self.plan.rank)]
            flat[lo:a].zero_()
            flat[b:hi].zero_()
            node_all_reduce(flat[lo:hi], members, self.plan.rank, ex.group, nodes)
        else:
            _ring_all_gather(flat, rows, members, self.plan.rank, ex.group)
        if slices:
            all_gather_ranges(flat, slices, p, tp)
        moved = ring_traffic(hi - lo, poly.element_size(), 1, (m, n))
        self.sum_bytes += 2 * sum(moved)


def node_all_reduce(flat: Tensor, members: tuple[int, ...], rank: int, group, nodes) -> None:
    """``ring_all_reduce``, hierarchical over nodes where each has ``m > 1`` members (the slow
    links carry ``1 / m``); one summation order, so all members get the same bits.

    Args:
        flat: the 1-D tensor, same size on every member; summed in place.
        members: the gang's ranks within ``group``, sorted.
        rank: this process's rank within ``group``.
        group: the DP process group.
        nodes: the node of every rank of ``group`` (empty: one flat ring).
    """
    m, n = node_layout(members, nodes)
    if m == 1 or n == 1:
        ring_all_reduce(flat, members, rank, group)
        return
    by_node: dict[int, list[int]] = {}
    for r in members:
        by_node.setdefault(nodes[r], []).append(r)
    local = by_node[nodes[rank]]
    p = local.index(rank)
    nxt, prev = local[(p + 1) % m], local[(p - 1) % m]
    chunks = [flat[a:b] for a, b in cut(flat.numel(), m)]
    own = _ring_reduce_scatter(chunks, p, nxt, prev, group)
    peers = tuple(sorted(ranks[p] for ranks in by_node.values()))  # chunk ``own`` everywhere
    ring_all_reduce(chunks[own], peers, rank, group)
    _ring_gather(chunks, own, nxt, prev, group)


def ring_all_reduce(flat: Tensor, members: tuple[int, ...], rank: int, group) -> None:
    """Sum ``flat`` in place over ``members`` with a ring; each chunk summed once, so all
    members get the same bits.

    Args:
        flat: the 1-D tensor, same size on every member; summed in place.
        members: the gang's ranks within ``group``, sorted.
        rank: this process's rank within ``group``.
        group: the DP process group.
    """
    k, p = len(members), members.index(rank)
    nxt, prev = members[(p + 1) % k], members[(p - 1) % k]
    chunks = [flat[a:b] for a, b in cut(flat.numel(), k)]
    _ring_gather(chunks, _ring_reduce_scatter(chunks, p, nxt, prev, group), nxt, prev, group)


def _ring_reduce_scatter(chunks: list[Tensor], p: int, nxt: int, prev: int, group) -> int:
    """k - 1 ring steps after which chunk ``p + 1`` is summed here; returns that index."""
    k = len(chunks)
    scratch = chunks[0].new_empty(max(c.numel() for c in chunks))
    for s in range(k - 1):
        send, recv = chunks[(p - s) % k], chunks[(p - s - 1) % k]
        _exchange(send, scratch[: recv.numel()], nxt, prev, group)
        recv.add_(scratch[: recv.numel()])
    return (p + 1) % k


def _ring_all_gather(flat: Tensor, bounds, members: tuple[int, ...], rank: int, group) -> None:
    """Member ``p`` holds ``flat``'s range ``bounds[p]``; a ring fills in the others in place."""
    k, p = len(members), members.index(rank)
    chunks = [flat[a:b] for a, b in bounds]
    _ring_gather(chunks, p, members[(p + 1) % k], members[(p - 1) % k], group)


def _ring_gather(chunks: list[Tensor], own: int, nxt: int, prev: int, group) -> None:
    """k - 1 ring steps after which every member holds every chunk; it starts with ``own``."""
    k = len(chunks)
    for s in range(k - 1):
        _exchange(chunks[(own - s) % k], chunks[(own - s - 1) % k], nxt, prev, group)


def _tp_slice(n: int, group) -> tuple[int, int, Optional[list], int]:
    """(start, end) of this TP rank's slice of ``n`` elements, all ranks' slices (None: sum it
    all) and this rank's index in ``group``."""
    k = group.size() if group is not None else 1
    if k == 1 or n < k:
        return 0, n, None, 0
    p = torch.distributed.get_rank(group)
    slices = cut(n, k)
    return (*slices[p], slices, p)


def _exchange(send: Tensor, recv: Tensor, to: int, frm: int, group) -> None:
    """Send to one peer while receiving from another; empty chunks are skipped (on both ends:
    both cut the same tensor alike)."""
    ops = []
    if send.numel():
        ops.append(P2POp(torch.distributed.isend, send, group=group, group_peer=to))
    if recv.numel():
        ops.append(P2POp(torch.distributed.irecv, recv, group=group, group_peer=frm))
    for work in torch.distributed.batch_isend_irecv(ops) if ops else []:
        work.wait()


class CommThread:
    """Serves submitted calls one at a time, in order; a daemon, so that a failed rank exits
    while a posted collective still waits for peers (docs/gangs.md)."""

    def __init__(self, initializer: Callable[[], None]):
        self._posts: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, args=(initializer,), name="muon-gang", daemon=True
        )
        self._thread.start()

    def submit(self, fn: Callable, *args) -> Future:
        """``fn(*args)`` on the thread, after every call submitted before it.

        Args:
            fn: the call.
            *args: its arguments.

        Returns:
            A future of its result (or of what it raised).
        """
        future: Future = Future()
        self._posts.put((future, fn, args))
        return future

    def close(self, wait: bool) -> None:
        """End the thread once it has served what was submitted; ``wait``: join it."""
        self._posts.put(None)
        if wait:
            self._thread.join()

    def _run(self, initializer) -> None:
        failed = None
        try:
            initializer()
        except BaseException as err:  # every call fails with it: the main thread raises it
            failed = err
        while (post := self._posts.get()) is not None:
            future, fn, args = post
            try:
                if failed is not None:
                    raise failed
                future.set_result(fn(*args))
            except BaseException as err:
                future.set_exception(err)


@dataclass(frozen=True)
class _Posted:
    """A posted gang collective: its future, its in-place tensor, the gang's members."""

    future: Future
    tensor: Tensor
    members: tuple[int, ...]


class CommStreams:
    """The communication thread's stream, ordered against the main thread's by events
    (docs/gangs.md, "Streams"); on CPU every method is a no-op."""

    def __init__(self, compute=None, comm=None):
        self.compute, self.comm = compute, comm

    @classmethod
    def of(cls, device) -> "CommStreams":
        """The streams for ``device``: none on CPU, else its current stream and a new one."""
        if device is None or torch.device(device).type == "cpu":
            return cls()
        return cls(torch.accelerator.current_stream(device), torch.Stream(device=device))

    def enter(self) -> None:
        """The communication thread's initializer: its current stream is ``comm``."""
        if self.comm is not None:
            torch.accelerator.set_stream(self.comm)

    def ready(self):
        """Main thread, at a post: an event after the work that produced the tensor."""
        return self.compute.record_event() if self.compute is not None else None

    def serve(self, serve, t: Tensor, ready):
        """Communication thread: ``serve(t)`` after ``ready``.

        Args:
            serve: the collective, in place on ``t``.
            t: the posted tensor.
            ready: ``ready()``'s event (None on CPU).

        Returns:
            An event after the collective, for ``done`` (None on CPU).
        """
        if ready is not None:
            self.comm.wait_event(ready)
        serve(t)
        return self.comm.record_event() if self.comm is not None else None

    def done(self, event) -> None:
        """Main thread, at a wait: its stream waits for the collective's ``event``."""
        if event is not None:
            self.compute.wait_event(event)


# ------------------------------------------------------------------- where gangs ring


def gang_nodes(group, nvlink_domain: Optional[int], inner, infos: list) -> tuple[int, ...]:
    """The node of every rank of the DP ``group`` as the planner sees it, the same on the TP
    peers of a DP rank.

    Args:
        group: the DP process group.
        nvlink_domain: GPUs per NVLink domain (``--muon-plan-nvlink-domain``); None: by host.
        inner: Muon's orthogonalizer before ``attach`` wraps it.
        infos: the TP-global infos of the optimizer's Muon params.

    Returns:
        One node id per rank of ``group``, in group rank order.
    """
    nodes = _domain_nodes(group, nvlink_domain) if nvlink_domain else _host_nodes(group)
    return shared_layout(nodes, _tp_groups(inner, infos))


def _host_nodes(group) -> tuple[int, ...]:
    """The node of every rank of ``group``, by host name (one collective)."""
    names: list = [None] * group.size()
    torch.distributed.all_gather_object(names, socket.gethostname(), group=group)
    first = {name: i for i, name in reversed(list(enumerate(names)))}
    ids = {name: n for n, name in enumerate(sorted(set(names), key=first.get))}
    return tuple(ids[name] for name in names)


def _domain_nodes(group, size: int) -> tuple[int, ...]:
    """The NVLink domain of every rank of ``group``: ``size`` consecutive global ranks each."""
    return tuple(r // size for r in torch.distributed.get_process_group_ranks(group))


def shared_layout(nodes: tuple[int, ...], groups: list) -> tuple[int, ...]:
    """TP rank 0's node layout on every rank of ``groups``: a DP rank's TP peers must run one
    plan, but their layouts can differ (a domain not a multiple of TP, TP across hosts).

    Args:
        nodes: this rank's layout of its DP group.
        groups: the TP groups sharding this optimizer's Muon params.

    Returns:
        The layout every rank of those groups plans with.
    """
    for group in groups:
        got: list = [None] * group.size()
        torch.distributed.all_gather_object(got, nodes, group=group)
        nodes = got[0]
    return nodes


def _tp_groups(inner, infos: list) -> list:
    """The (expert) TP groups of more than one rank sharding ``infos``' params, dense first."""
    if not isinstance(inner, TPOrthogonalizer):
        return []
    groups = {}
    for info in infos:
        group = inner._group(info)
        if group is not None:
            groups.setdefault(bool(getattr(info, "expert", False)), group)
    return [groups[expert] for expert in sorted(groups)]
