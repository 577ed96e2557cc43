"""Our Muon under ZeRO-3 (Megatron-FSDP, torch FSDP2): each ZeRO-3 shard of a matrix is a range of
its flattened elements, as under the DistributedOptimizer, so the plan and the exchange run
unchanged; this module reads the two layouts (why and what differs: docs/fsdp.md, "Muon")."""

import dataclasses
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from .exchange import (
    DTYPES,
    BucketSlot,
    DistributedMuonOrthogonalizer,
    MatrixSlot,
    ShardInfo,
)
from .functional import MuonParamInfo, OrthoSpec
from .planner.cost_model import DEFAULT_LINKS, PlanLinks
from .planner.gangs import GangRunner, gang_nodes
from .planner.plan import MuonExchangePlan, exchange_cost_model
from .tp import owners_orthogonalizer


@dataclass(frozen=True, eq=False)
class HeldMatrix:
    """A Muon matrix as a ZeRO-3 layout holds it: elements ``[start, end)`` of a flat bucket
    that the DP ``group`` cuts into shards of ``shard_size`` elements (rank ``r``: the r-th)."""

    param: Tensor  # the optimizer's param (a DTensor, or this rank's plain piece)
    name: str
    group: object  # the DP process group sharding it
    bucket: Hashable  # matrices that share a flat bucket share this key
    start: int
    end: int
    shard_size: int
    local_shape: tuple[int, int]  # TP-local, as stored
    info: MuonParamInfo  # TP-global shape and QKV split

    def held(self, rank: int) -> tuple[int, int]:
        """The range of the flattened matrix DP rank ``rank`` holds (``lo == hi``: none)."""
        lo = max(self.start, rank * self.shard_size)
        hi = min(self.end, (rank + 1) * self.shard_size)
        return (lo - self.start, max(lo, hi) - self.start)


@dataclass(frozen=True, eq=False)
class Zero3ShardInfo(ShardInfo):
    """A Muon ZeRO-3 param: ``ShardInfo`` plus the exchange (one per DP group) it belongs to."""

    plan: int = 0  # index into Zero3Orthogonalizer.exchanges


def local(tensor: Tensor) -> Tensor:
    """This rank's piece of ``tensor`` (a DTensor's local tensor; a plain tensor itself)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(template: Tensor, flat: Tensor) -> Tensor:
    """``flat`` (this rank's piece, flattened) in ``template``'s form: a DTensor with its mesh,
    placements and global shape where ``template`` is one (no communication)."""
    if not isinstance(template, DTensor):
        return flat.view(template.shape)
    piece = flat.view(template.to_local().shape)
    return DTensor.from_local(
        piece,
        template.device_mesh,
        template.placements,
        run_check=False,
        shape=template.shape,
        stride=template.stride(),
    )


# ------------------------------------------------------------------ reading the two layouts


def fsdp2_matrix(param: Tensor, name: str, info: MuonParamInfo) -> HeldMatrix:
    """The layout of one torch FSDP2 param (``Shard(0)``; ``Replicate`` over an HSDP outer dim).

    Args:
        param: a 2-D DTensor param.
        name: its name (logs, plan).
        info: its TP-global ``MuonParamInfo``.

    Returns:
        Its ``HeldMatrix``: the matrix is its own bucket, cut in row blocks of ``ceil(rows/dp)``.
    """
    if not isinstance(param, DTensor):
        raise ValueError(f"{name}: not a DTensor; FSDP2's fully_shard makes its params DTensors")
    dims = [d for d, p in enumerate(param.placements) if p == Shard(0)]
    others = [p for d, p in enumerate(param.placements) if d not in dims]
    if len(dims) != 1 or any(not isinstance(p, Replicate) for p in others):
        raise ValueError(
            f"{name}: placements {param.placements}; Muon under FSDP2 takes Shard(0) over one "
            "mesh dimension (Replicate elsewhere, e.g. HSDP)"
        )
    group = param.device_mesh.get_group(dims[0])
    rows, cols = param.shape
    shard = -(-rows // group.size()) * cols  # torch.chunk's rows per rank, as FSDP2 cuts
    held = HeldMatrix(
        param, name, group, ("fsdp2", name), 0, rows * cols, shard, (rows, cols), info
    )
    _check_held(held)
    return held


def megatron_fsdp_matrix(param: Tensor, name: str, info: MuonParamInfo) -> HeldMatrix:
    """The layout of one Megatron-FSDP optimizer param (``orig_param``: the module's param).

    Args:
        param: one of Megatron-FSDP's ``optimizer_named_parameters``.
        name: its name.
        info: its TP-global ``MuonParamInfo``.

    Returns:
        Its ``HeldMatrix``: a range of its parameter group's flat buffer.
    """
    fsdp = getattr(param, "_megatron_fsdp_model", None)
    orig = getattr(param, "orig_param", None)
    if fsdp is None or orig is None:
        raise ValueError(f"{name}: not a Megatron-FSDP optimizer param (no orig_param)")
    buffers = fsdp.param_and_grad_buffer
    index = buffers.param_to_param_group[orig]
    group = buffers.parameter_groups[index]
    buffer = group.main_weight_buffer or group.model_weight_buffer
    if buffer is None or not _sharded(buffers):
        raise ValueError(
            f"{name}: Megatron-FSDP keeps whole params here (data_parallel_sharding_strategy "
            "'no_shard'); Muon under Megatron-FSDP takes 'optim', 'optim_grads' or "
            "'optim_grads_params'"
        )
    item = buffer.item_index_map[buffer.param_idx[orig]]
    start = item.global_data_index - buffer.bucket_index.global_data_index
    shard = buffer.bucket_index.size // buffer.dp_world_size
    shape = tuple(item.shape)
    held = HeldMatrix(
        param, name, buffer.data_parallel_group, (id(buffers), index), start,
        start + item.size, shard, (shape[0], shape[1]), info,
    )  # fmt: skip
    assert buffer.dp_rank == buffer.data_parallel_group.rank(), "HSDP's split dp rank"
    _check_held(held)
    return held


def _sharded(buffers) -> bool:
    return buffers.bucketing_policy.data_parallel_sharding_strategy != "no_shard"


def _check_held(held: HeldMatrix) -> None:
    """The layout read here is the one the framework built: this rank's piece has its size."""
    lo, hi = held.held(held.group.rank())
    size = local(held.param).numel()
    if size != hi - lo:
        raise AssertionError(
            f"{held.name}: the ZeRO-3 layout read gives {hi - lo} elements on this rank, the "
            f"param holds {size}"
        )


# ------------------------------------------------------------------ plans and the orthogonalizer


def build_plans(matrices: list[HeldMatrix], model: Callable) -> list[tuple[MuonExchangePlan, list]]:
    """One exchange plan per DP group (dense, expert), in first-seen order (the same everywhere).

    Args:
        matrices: the Muon params' layouts, in optimizer order.
        model: group -> the Newton-Schulz cost model (``NSCostModel``) to plan it with.

    Returns:
        [(plan, the ``HeldMatrix`` of each of its matrices)].
    """
    by_group: dict[int, list[HeldMatrix]] = {}
    for held in matrices:
        by_group.setdefault(id(held.group), []).append(held)
    out = []
    for members in by_group.values():
        group = members[0].group
        keys = list(dict.fromkeys(h.bucket for h in members))
        buckets = [BucketSlot(group=group, shard_size=0) for _ in keys]
        order = sorted(members, key=lambda h: (keys.index(h.bucket), h.start))
        slots = []
        cost = model(group)
        for i, held in enumerate(order):
            b = keys.index(held.bucket)
            buckets[b].shard_size = held.shard_size
            buckets[b].matrices.append(i)
            slots.append(
                MatrixSlot(
                    held.name, b, held.start, held.end, held.local_shape, held.info,
                    cost.whole(held.info),
                )
            )  # fmt: skip
        plan = MuonExchangePlan(buckets, slots, group.rank(), group.size(), None, cost)
        out.append((plan, order))
    return out


class Zero3Orthogonalizer:
    """Orthogonalizer for ZeRO-3 Muon params (DTensors or local pieces): per DP group, this
    rank's pieces go through the DistOpt exchange (``DistributedMuonOrthogonalizer``) to their
    owners and back; the results come back in the params' form."""

    def __init__(self, exchanges: list[DistributedMuonOrthogonalizer]):
        self.exchanges = exchanges

    @property
    def bytes_moved(self) -> int:
        """Bytes this rank's exchanges moved in the last step (sent + received)."""
        return sum(ex.bytes_moved for ex in self.exchanges)

    def __call__(self, updates: list[Tensor], infos: list, spec: OrthoSpec) -> list[Tensor]:
        if any(not isinstance(info, Zero3ShardInfo) for info in infos):
            raise AssertionError("Zero3Orthogonalizer needs the Zero3ShardInfo of every update")
        results: list[Optional[Tensor]] = [None] * len(updates)
        for j, exchange in enumerate(self.exchanges):  # every rank, in the same order
            mine = [k for k, info in enumerate(infos) if info.plan == j]
            held = [k for k in mine if local(updates[k]).numel()]
            pieces = [local(updates[k]).reshape(-1) for k in held]
            outs = exchange(pieces, [infos[k] for k in held], spec)
            for k, out in zip(held, outs):
                results[k] = _like(updates[k], out.reshape(-1))
        # a rank holding none of a matrix (FSDP2's last ranks of a short one) updates nothing
        return [r if r is not None else torch.zeros_like(u) for r, u in zip(results, updates)]


def attach_zero3(
    muon,
    matrices: list[HeldMatrix],
    exchange_dtype: str = "fp32",
    links: PlanLinks = DEFAULT_LINKS,
    update_dtype: Optional[torch.dtype] = None,
) -> Zero3Orthogonalizer:
    """Make ``muon`` step ZeRO-3 params exactly (``Zero3ShardInfo``s, the exchange around NS).

    Args:
        muon: a ``Muon`` whose Muon params are those of ``matrices``; modified in place.
        matrices: the layout of every Muon param (``fsdp2_matrix``, ``megatron_fsdp_matrix``).
        exchange_dtype: ``muon_distopt_exchange_dtype``.
        links: the machine the planner assumes.
        update_dtype: the dtype of the updates ``muon`` computes; None: the params'.

    Returns:
        The orthogonalizer installed.
    """
    dtype = exchange_dtype if exchange_dtype in DTYPES else "fp32"  # unknown: refused below
    base, ns_dtype = exchange_cost_model(muon, dtype, links, "under FSDP")
    infos = [m.info for m in matrices]

    def model(group):
        nodes = gang_nodes(group, links.nvlink_domain, muon.orthogonalizer, infos)
        return dataclasses.replace(base, nodes=nodes)

    owners = owners_orthogonalizer(muon.orthogonalizer, infos)
    update_dtype = update_dtype or _update_dtype(matrices)
    device = local(matrices[0].param).device if matrices else None
    exchanges, by_param = [], {}
    for j, (plan, order) in enumerate(build_plans(matrices, model)):
        gangs = GangRunner(muon.orthogonalizer)
        gangs.make_groups(plan)
        exchanges.append(
            DistributedMuonOrthogonalizer(
                plan, owners, exchange_dtype, ns_dtype, update_dtype, device=device,
                gangs=gangs,
            )
        )  # fmt: skip
        rank = plan.rank
        for i, held in enumerate(order):
            offset = held.held(rank)[0]
            by_param[held.param] = Zero3ShardInfo(
                held.info.shape, held.info.qkv_split, i, offset, plan=j
            )
    _set_infos(muon, by_param)
    muon.orthogonalizer = Zero3Orthogonalizer(exchanges)
    # a per-rank raise on a non-finite grad would leave peers waiting in the exchange
    muon.on_nonfinite_grad = "ignore"
    return muon.orthogonalizer


def _update_dtype(matrices: list[HeldMatrix]) -> torch.dtype:
    dtypes = {m.param.dtype for m in matrices}
    if len(dtypes) > 1:
        raise ValueError(f"Muon params under FSDP in several dtypes {dtypes}; expected one")
    return dtypes.pop() if dtypes else torch.float32


def _set_infos(muon, by_param: dict) -> None:
    """``muon.param_info`` and ``MegatronMuon``'s per-position infos to the ZeRO-3 infos."""
    for g, group in enumerate(muon.param_groups):
        if not group["use_muon"]:
            continue
        infos = [by_param[p] for p in group["params"]]
        if hasattr(muon, "group_infos"):
            muon.group_infos[g] = infos
        muon.param_info.update(zip(group["params"], infos))


# ------------------------------------------------------------------ entry points


SHARDED_STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


def check_megatron_fsdp(config, model_chunks) -> None:
    """ValueError naming the setting, where our Muon cannot run under Megatron-FSDP.

    Args:
        config: the ``OptimizerConfig`` (``muon_impl='megatron_muon'``).
        model_chunks: the model chunks (their ``ddp_config``).
    """
    for chunk in model_chunks:
        ddp = chunk.ddp_config
        strategy = ddp.data_parallel_sharding_strategy
        if strategy not in SHARDED_STRATEGIES:
            raise ValueError(
                f"data_parallel_sharding_strategy={strategy!r} with use_megatron_fsdp=True and "
                f"optimizer='muon': our Muon takes {list(SHARDED_STRATEGIES)}"
            )
        if ddp.num_distributed_optimizer_instances > 1:
            _check_hsdp(ddp)
        if getattr(ddp, "megatron_fsdp_use_decoupled_grad", False):
            raise ValueError(
                "megatron_fsdp_use_decoupled_grad=True (--use-precision-aware-optimizer) with "
                "optimizer='muon': Muon keeps its state in the main params' dtype"
            )


def _check_hsdp(ddp) -> None:
    outer = ddp.outer_dp_sharding_strategy
    if outer != "no_shard":
        raise ValueError(
            f"outer_dp_sharding_strategy={outer!r} (--outer-dp-sharding-strategy) with "
            "HSDP (num_distributed_optimizer_instances > 1) and optimizer='muon': our Muon "
            "takes 'no_shard' there (its exchange runs within a shard group)"
        )
    if not ddp.overlap_grad_reduce:  # 'optim' (the others turn it on themselves)
        raise ValueError(
            f"data_parallel_sharding_strategy={ddp.data_parallel_sharding_strategy!r} with HSDP "
            "(num_distributed_optimizer_instances > 1) and optimizer='muon' needs "
            "--overlap-grad-reduce: without it Megatron-FSDP never sums the replicas' gradients, "
            "and each replica steps on its own (AdamW too: docs/fsdp.md)"
        )


def muon_params(muon) -> list[Tensor]:
    """The Muon (``use_muon``) params of ``muon``, in group order."""
    return [p for g in muon.param_groups if g["use_muon"] for p in g["params"]]


def attach_fsdp2(
    muon,
    names: Optional[dict] = None,
    exchange_dtype="fp32",
    links=DEFAULT_LINKS,
    update_dtype: Optional[torch.dtype] = None,
):
    """``attach_zero3`` for a ``Muon`` over torch FSDP2 (``fully_shard``) params.

    Args:
        muon: the ``Muon`` (``MegatronMuon``) whose Muon params are FSDP2 DTensors.
        names: {param: name}, for the plan's logs; else positional names.
        exchange_dtype: ``muon_distopt_exchange_dtype``.
        links: the machine the planner assumes.
        update_dtype: the dtype ``muon`` steps (Megatron's wrappers: fp32 main params); None:
            the params'.

    Returns:
        The orthogonalizer installed.
    """
    names = names or {}
    matrices = [
        fsdp2_matrix(p, names.get(p, f"muon_param_{i}"), muon.param_info[p])
        for i, p in enumerate(muon_params(muon))
    ]
    return attach_zero3(muon, matrices, exchange_dtype, links, update_dtype)


def attach_megatron_fsdp(muon, exchange_dtype="fp32", links=DEFAULT_LINKS):
    """``attach_zero3`` for a ``Muon`` over Megatron-FSDP's optimizer params.

    Args:
        muon: the ``MegatronMuon`` inside Megatron-FSDP's ``DistributedOptimizer``.
        exchange_dtype: ``muon_distopt_exchange_dtype``.
        links: the machine the planner assumes.

    Returns:
        The orthogonalizer installed.
    """
    matrices = []
    for p in muon_params(muon):
        fsdp, orig = getattr(p, "_megatron_fsdp_model", None), getattr(p, "orig_param", None)
        name = fsdp.param_to_name.get(orig, "?") if fsdp is not None else "?"
        matrices.append(megatron_fsdp_matrix(p, name, muon.param_info[p]))
    return attach_zero3(muon, matrices, exchange_dtype, links)


def groups_by_name(distopt, state_dict: dict) -> dict:
    """An fsdp_dtensor optimizer state dict with its ``param_groups`` rebuilt from
    ``param_to_group_meta`` (upstream's rule), a group without params taking this run's settings:
    the map by param name cannot carry them, and our Muon keeps its (empty) Muon and AdamW halves
    of every group (factory.py), which upstream's rebuild leaves without ``use_muon``.

    Args:
        distopt: the Megatron-FSDP ``MuonDistributedOptimizer`` loading.
        state_dict: the checkpoint's optimizer state dict.

    Returns:
        The state dict to hand upstream's ``load_state_dict``.
    """
    if "param_to_group_meta" not in state_dict:
        return state_dict
    current = distopt.optimizer.param_groups
    groups = distopt._param2group_meta_to_param_groups(state_dict["param_to_group_meta"], current)
    for group, mine in zip(groups, current):
        if not group["params"]:
            group.update({k: v for k, v in mine.items() if k != "params"})
    out = {k: v for k, v in state_dict.items() if k != "param_to_group_meta"}
    out["param_groups"] = groups
    return out
