"""Bench-only baseline: the published proof of concept's way to run Muon under DistOpt.

Every rank all-gathers every Muon bucket over DP and orthogonalizes *every* matrix itself, then
keeps its own shard of each result. Exact, like ours, but each rank does the whole model's
Newton-Schulz work and receives all Muon momentum bytes. Plugged in through the inner optimizer's
``orthogonalizer`` attribute, around the same orthogonalizer our owners run
(``distrib_optimizer.attach``), so only the DP exchange differs from ours:

    use_gather_everything(optimizer)   # after get_megatron_optimizer(..., DistOpt + Muon)
"""

import torch
from torch import Tensor

from megatron.core.optimizer.megatron_muon.planner.plan import MuonExchangePlan, piece


class GatherEverythingOrthogonalizer:
    """Orthogonalizer for DP-sharded Muon params: all-gather per bucket, NS everywhere."""

    def __init__(
        self, plan: MuonExchangePlan, inner, dtype: torch.dtype = torch.float32, device=None
    ):
        self.plan, self.inner, self.dtype, self.device = plan, inner, dtype, device
        self.bytes_moved = 0  # of the last step: sent + received, own shard excluded

    def __call__(self, updates: list[Tensor], infos: list, spec) -> list[Tensor]:
        by_matrix = {info.matrix: u for u, info in zip(updates, infos)}
        whole: dict[int, Tensor] = {}
        self.bytes_moved = 0
        for bucket in self.plan.buckets:
            whole.update(self._gather_bucket(bucket, by_matrix))
        ids = sorted(whole)
        infos_all = [self.plan.matrices[i].info for i in ids]
        results = dict(zip(ids, self.inner([whole[i] for i in ids], infos_all, spec)))
        pieces = [self._own_piece(results[i.matrix], i.matrix) for i in infos]
        return [p.to(u.dtype) for p, u in zip(pieces, updates)]

    def _sizes(self, bucket, rank: int) -> list[int]:
        """Elements of each Muon matrix of ``bucket`` (in bucket order) that ``rank`` holds."""
        out = []
        for i in bucket.matrices:
            lo, hi = piece(self.plan.matrices[i], rank, bucket.shard_size)
            out.append(max(0, hi - lo))
        return out

    def bytes_per_step(self, itemsize: int) -> int:
        """Bytes this rank sends plus receives per step (counted from the layout, no step)."""
        total = 0
        for bucket in self.plan.buckets:
            world = bucket.group.size()
            pad = max(sum(self._sizes(bucket, r)) for r in range(world))
            total += 2 * (world - 1) * pad * itemsize
        return total

    def _gather_bucket(self, bucket, by_matrix: dict) -> dict[int, Tensor]:
        world = bucket.group.size()
        sizes = [self._sizes(bucket, r) for r in range(world)]
        pad = max(sum(s) for s in sizes)
        own = zip(bucket.matrices, sizes[self.plan.rank])
        mine = [by_matrix[i].reshape(-1).to(self.dtype) for i, n in own if n]
        device = self.device
        send = torch.zeros(pad, dtype=self.dtype, device=device)
        if mine:
            flat = torch.cat(mine)
            send[: flat.numel()] = flat
        out = torch.empty(world * pad, dtype=self.dtype, device=device)
        torch.distributed.all_gather_into_tensor(out, send, group=bucket.group)
        self.bytes_moved += 2 * (world - 1) * pad * send.element_size()
        return self._assemble(bucket, out.view(world, pad), sizes)

    def _assemble(self, bucket, gathered: Tensor, sizes: list) -> dict[int, Tensor]:
        parts: dict[int, list] = {i: [] for i in bucket.matrices}
        for rank, row in enumerate(gathered):
            at = 0
            for i, n in zip(bucket.matrices, sizes[rank]):
                parts[i].append(row[at : at + n])
                at += n
        return {
            i: torch.cat(parts[i]).view(self.plan.matrices[i].local_shape) for i in bucket.matrices
        }

    def _own_piece(self, result: Tensor, i: int) -> Tensor:
        slot = self.plan.matrices[i]
        lo, hi = piece(slot, self.plan.rank, self.plan.buckets[slot.bucket].shard_size)
        return result.reshape(-1)[lo - slot.start : hi - slot.start]


def distopts(optimizer) -> list:
    """The DistributedOptimizer instances inside a (possibly chained) Megatron optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def use_gather_everything(optimizer) -> None:
    """Swap our owner-based exchange for the gather-everything baseline (same TP orthogonalizer)."""
    for distopt in distopts(optimizer):
        if getattr(distopt, "muon_plan", None) is None:
            continue
        ours = distopt.optimizer.orthogonalizer
        distopt.optimizer.orthogonalizer = GatherEverythingOrthogonalizer(
            distopt.muon_plan, ours.inner, ours.dtype, ours.device
        )
