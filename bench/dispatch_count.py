"""Kernel launches and host syncs of one ``optimizer.step()``, counted on CPU ranks.

    .venv/bin/python bench/dispatch_count.py          # 8 layers, DP 2, bf16 (~1 min)
    .venv/bin/python bench/dispatch_count.py --layers 2

A ``TorchDispatchMode`` sees every aten op a step dispatches, on CPU as on a GPU: each one that
computes is a kernel a GPU would launch. Views, ``detach`` and allocations launch nothing and
are set aside; collectives are counted apart. A host sync is an op that hands a tensor's value
to Python (``_local_scalar_dense``: ``.item()``, ``bool()``, ``float()``; ``nonzero``,
``is_nonzero``, ``equal``), except on a tensor that torch keeps on the host on a GPU too: the
scalar ``step`` of torch's Adam/AdamW state (``capturable=False``). Variants as in
bench/step_cost.py's bf16 comparison: AdamW + DistributedOptimizer, ours (``--muon-impl
megatron_muon`` in the DistributedOptimizer), upstream's LayerWise Muon.

What differs from a GPU: torch's Adam runs its single-tensor loop on CPU (``foreach`` only on
CUDA by default), so AdamW's op count here is the CPU fallback's, not the GPU's.
"""

import argparse
import collections
import dataclasses
import os
import sys
from contextlib import contextmanager

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "tests")]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

aten = torch.ops.aten
# Launch nothing: metadata-only views and aliases, and fresh (uninitialized) storage.
NO_KERNEL = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
    aten.as_strided.default, aten.slice.Tensor, aten.select.int, aten.t.default,
    aten.transpose.int, aten.permute.default, aten.expand.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int, aten.narrow.default, aten.detach.default, aten.lift_fresh.default,
    aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.empty_like.default, aten.view_as_real.default,
    aten.view_as_complex.default, aten._reshape_alias.default, aten.unflatten.int,
    aten.flatten.using_ints, aten.chunk.default, aten.diagonal.default,
}  # fmt: skip
HOST_SYNC = {
    aten._local_scalar_dense.default, aten.nonzero.default, aten.is_nonzero.default,
    aten.equal.default,
}  # fmt: skip


@dataclasses.dataclass
class Counts:
    kernels: int = 0
    host_syncs: int = 0
    host_reads: int = 0  # reads of host-resident scalars (torch Adam's ``step``): no device sync
    collectives: int = 0
    by_op: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class DispatchCounter(TorchDispatchMode):
    """Counts kernels, host syncs and collectives dispatched inside ``with``; ``host_resident``:
    tensors that live on the host on a GPU as well (their reads are no device sync)."""

    def __init__(self, host_resident=()):
        super().__init__()
        self.counts = Counts()
        self._host = {t.untyped_storage().data_ptr() for t in host_resident}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.name()
        c = self.counts
        if func.namespace == "profiler":  # record_function markers: no kernel
            return out
        if func.namespace in ("c10d", "_c10d_functional"):
            c.collectives += 1
        elif func in HOST_SYNC:
            if args and self._on_host(args[0]):
                c.host_reads += 1
            else:
                c.host_syncs += 1
                c.by_op["sync " + name] += 1
        elif func not in NO_KERNEL:
            c.kernels += 1
            c.by_op[name] += 1
        return out

    def _on_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self._host


def adam_steps(optimizer) -> list:
    """torch Adam/AdamW's scalar ``step`` tensors (host-resident on a GPU too) in every leaf."""
    from step_cost import leaves

    steps = []
    for leaf in leaves(optimizer):
        for state in leaf.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.dim() == 0:
                steps.append(step)
    return steps


@contextmanager
def counted(optimizer):
    """Count what ``optimizer.step()`` dispatches inside the block (steps tensors taken as they
    are when the block starts: run one step first so that lazily created state exists)."""
    counter = DispatchCounter(adam_steps(optimizer))
    step = optimizer.step

    def wrapped():
        with counter:
            return step()

    optimizer.step = wrapped
    try:
        yield counter.counts
    finally:
        optimizer.step = step


def spec(layers: int):
    from tiny_gpt import TinyGPT

    return TinyGPT(num_layers=layers, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                   ffn_hidden_size=352, vocab_size=256, seq_length=32, micro_batch_size=2,
                   global_batch_size=4)  # fmt: skip


VARIANTS = ("adamw", "ours", "layerwise")
PER_MATRIX = "_per_matrix"  # a variant's name + this: ours with a chain per matrix (no batches)


def _rank(layers: int, variants=VARIANTS) -> dict:
    from step_cost import BF16, build_variant, leaves
    from tiny_gpt import global_batches, train_step

    out = {}
    for who in variants:
        base = who.removesuffix(PER_MATRIX)
        s, model, optimizer = build_variant(spec(layers), BF16[(base, False)], distopt=True)
        for leaf in leaves(optimizer) if who != base else ():
            leaf.optimizer.ns_batch_bytes = 1  # every matrix a batch of its own
            leaf.optimizer._specs.clear()
        batches = global_batches(s, 2)
        train_step(s, model, optimizer, batches[0])  # state exists from here on
        with counted(optimizer) as counts:
            train_step(s, model, optimizer, batches[1])
        out[who] = counts
    return out


def measure(layers: int = 8, variants=VARIANTS) -> list[dict]:
    """Per rank: {variant: Counts} of the second step (DP 2, bf16)."""
    from harness import run_distributed

    return run_distributed(_rank, 2, args=(layers, variants), timeout=600.0)


def table(ranks: list[dict]) -> str:
    rows = [
        "| variant | kernels | host syncs | host-scalar reads | collectives |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for who in ranks[0]:
        k, s, h, c = (
            max(getattr(r[who], f) for r in ranks)
            for f in ("kernels", "host_syncs", "host_reads", "collectives")
        )
        rows.append(f"| {who} | {k} | {s} | {h} | {c} |")
    ours, lw = (max(r[w].kernels for r in ranks) for w in ("ours", "layerwise"))
    rows.append(f"\nours / LayerWise kernels: {ours / lw:.3f}x (max over ranks)")
    return "\n".join(rows)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--top", type=int, default=0, help="print each variant's top ops")
    args = parser.parse_args(argv)
    ranks = measure(args.layers)
    print(table(ranks))
    for who, counts in ranks[0].items() if args.top else ():
        print(who, counts.by_op.most_common(args.top))
    return ranks


if __name__ == "__main__":
    main()
