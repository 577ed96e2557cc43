"""Bench-only: what every collective of a step moves on this rank, recorded from the calls.

    with CollectiveRecorder() as calls:
        train_step(...)
    sum(c.bytes for c in calls)

Wraps the ``torch.distributed`` collectives Megatron's DDP buffers, its optimizers and ours call
(and the aliases ``param_and_grad_buffer`` binds at import) while the block runs; each call is
recorded with its op, elements, element size, group size and the bytes this rank sends plus
receives, counted as a bandwidth-optimal (ring) algorithm moves them (``rank_bytes``); own data
is not counted. Gloo's own algorithms may move more; the figure is the one a GPU cluster's
NCCL ring pays, from the very tensors the run hands the collectives. Nested calls (a wrapper
that calls another collective) count once, at the outermost call.
"""

import functools
import inspect
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

_WRAPPED = (
    "all_reduce",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "all_gather",
    "all_to_all_single",
    "batch_isend_irecv",
    "broadcast",
)
# Megatron's DDP buffers call these aliases, bound when the module is imported.
_BUFFER_ALIASES = {
    "dist_reduce_scatter_func": "reduce_scatter_tensor",
    "dist_all_gather_func": "all_gather_into_tensor",
}


@dataclass(frozen=True)
class Call:
    op: str
    numel: int  # elements of the call's input (for a list op: this rank's part)
    itemsize: int
    world: int
    bytes: int  # sent + received by this rank (ring), own data excluded
    dtype: str = ""  # the input's dtype, torch's name without "torch."
    ranks: tuple = ()  # the group's global ranks (empty: the default group)


def rank_bytes(op: str, numel: int, itemsize: int, world: int, **kw) -> int:
    """Bytes one rank sends plus receives for a collective over ``world`` ranks (ring):
    reduce-scatter of N: ``2 (w-1) N/w``; all-gather of n per rank: ``2 (w-1) n``; all-reduce of N:
    ``4 (w-1) N/w`` (reduce-scatter + all-gather); all-to-all: what leaves and what arrives,
    own split excluded (``sent``, ``received`` elements); send/recv: their tensors."""
    if world <= 1:
        return 0
    if op == "reduce_scatter_tensor":
        return 2 * (world - 1) * (numel // world) * itemsize
    if op in ("all_gather_into_tensor", "all_gather"):
        return 2 * (world - 1) * numel * itemsize
    if op == "all_reduce":
        return 4 * (world - 1) * numel * itemsize // world
    if op in ("all_to_all_single", "batch_isend_irecv"):
        return (kw["sent"] + kw["received"]) * itemsize
    if op == "broadcast":
        return 2 * (world - 1) * numel * itemsize // world
    raise ValueError(f"no byte rule for {op}")


def _world(group) -> int:
    return dist.get_world_size(group)


def _describe(op: str, a: dict) -> Call:
    if op == "batch_isend_irecv":
        ops = a["p2p_op_list"]
        sent = sum(p.tensor.numel() for p in ops if p.op in (dist.isend, dist.send))
        received = sum(p.tensor.numel() for p in ops if p.op not in (dist.isend, dist.send))
        item = ops[0].tensor.element_size() if ops else 0
        b = rank_bytes(op, sent + received, item, 2, sent=sent, received=received)
        return Call(op, sent + received, item, 2, b)
    group = a.get("group")
    world = _world(group)
    if op == "all_to_all_single":
        inp, out = a["input"], a["output"]
        me = dist.get_rank(group)
        ins = a.get("input_split_sizes") or [inp.shape[0] // world] * world
        outs = a.get("output_split_sizes") or [out.shape[0] // world] * world
        row_in = inp[0].numel() if inp.dim() > 1 else 1
        row_out = out[0].numel() if out.dim() > 1 else 1
        sent = (sum(ins) - ins[me]) * row_in
        received = (sum(outs) - outs[me]) * row_out
        b = rank_bytes(op, 0, inp.element_size(), world, sent=sent, received=received)
        return Call(op, inp.numel(), inp.element_size(), world, b, _dtype(inp), _ranks(group))
    if op == "all_gather":
        t = a["tensor"]
    elif op in ("all_reduce", "broadcast"):
        t = a["tensor"]
    else:  # reduce_scatter_tensor(output, input), all_gather_into_tensor(output_tensor, input)
        t = a.get("input", a.get("input_tensor"))
    b = rank_bytes(op, t.numel(), t.element_size(), world)
    return Call(op, t.numel(), t.element_size(), world, b, _dtype(t), _ranks(group))


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _ranks(group) -> tuple:
    return () if group is None else tuple(dist.get_process_group_ranks(group))


class CollectiveRecorder:
    """Context manager: records every wrapped collective called on this rank (any thread)."""

    def __init__(self):
        self.calls: list[Call] = []
        self._local = threading.local()
        self._saved: list = []

    def _wrap(self, op: str, fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)  # a recorder inside another one reads the call's own signature
        def wrapper(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                a = dict(sig.bind(*args, **kwargs).arguments)
                for name in [n for n, p in sig.parameters.items() if p.kind == p.VAR_KEYWORD]:
                    a.update(a.pop(name, {}))  # a wrapper's **kw (cpu_mode's all-to-all)
                self.calls.append(_describe(op, a))
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        return wrapper

    def __enter__(self) -> list:
        from megatron.core.distributed import param_and_grad_buffer as buffers

        targets = [(dist, name, name) for name in _WRAPPED]
        targets += [(buffers, alias, op) for alias, op in _BUFFER_ALIASES.items()]
        for module, name, op in targets:
            fn = getattr(module, name)
            self._saved.append((module, name, fn))
            setattr(module, name, self._wrap(op, fn))
        return self.calls

    def __exit__(self, *exc):
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()
        return False


def total(calls: list, ops=None) -> int:
    """Bytes of the recorded calls (of ``ops`` only, if given)."""
    return sum(c.bytes for c in calls if ops is None or c.op in ops)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))
