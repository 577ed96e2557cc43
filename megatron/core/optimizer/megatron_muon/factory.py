"""Muon inside Megatron: which params take Muon, their groups, the factory hooks patch 0002
calls (``check_muon_supported``, ``build_muon``) and upstream's ``TensorParallelMuon``
constructor. Map of the modules: docs/muon_in_megatron.md.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from ... import parallel_state
from ...utils import get_pg_size
from .config import (
    EXCHANGE_DTYPES,
    TP_MODES,
    check_choice,
    is_megatron_muon,
    validate_muon_config,
)
from .functional import MuonParamInfo
from .optimizer import Muon
from .planner.cost_model import DEFAULT_LINKS, PlanLinks
from .tp import TPOrthogonalizer


@dataclass(frozen=True)
class MegatronMuonParamInfo(MuonParamInfo):
    """``MuonParamInfo`` plus Megatron's ``partition_dim`` (0 rows, 1 columns, None: not TP
    split) and ``expert`` (sharded over the expert-TP group); docs/tp_modes.md."""

    partition_dim: Optional[int] = None
    expert: bool = False


def _is_muon_param(param: Tensor, name: str = "") -> bool:
    """2-D weights except embeddings and the output layer (Megatron marks those, but not the
    learned position embeddings: ``name`` tells them)."""
    if param.ndim != 2 or getattr(param, "is_embedding_or_output_parameter", False):
        return False
    return not name.endswith("embedding.position_embeddings.weight")


def is_expert_param(param: Tensor) -> bool:
    """Expert-parallel params: Megatron marks them ``allreduce=False`` (DDP, param groups)."""
    return not getattr(param, "allreduce", True)


def tp_groups(pg_collection=None) -> dict[bool, Any]:
    """{expert?: TP process group}: the groups a TP-sharded (expert) weight is split over."""
    if pg_collection is not None and hasattr(pg_collection, "tp"):
        return {False: pg_collection.tp, True: pg_collection.expt_tp}
    return {
        False: parallel_state.get_tensor_model_parallel_group(),
        True: parallel_state.get_expert_tensor_parallel_group(),
    }


def dp_groups(pg_collection=None) -> dict[bool, Any]:
    """{expert?: DP group}: the ranks whose (expert) TP shards DDP keeps equal (``owner`` mode)."""
    if pg_collection is not None and hasattr(pg_collection, "dp_cp"):
        return {False: pg_collection.dp_cp, True: getattr(pg_collection, "expt_dp", None)}
    return {
        False: parallel_state.get_data_parallel_group(with_context_parallel=True),
        True: parallel_state.get_expert_data_parallel_group(check_initialized=False),
    }


def _agree_across(local_ok: bool, groups: dict, device=None) -> bool:
    """True iff ``local_ok`` holds on every rank of the TP ``groups``; with two distinct groups,
    over all ranks, so that no chain of overlapping groups can disagree."""
    active = [g for g in {id(g): g for g in groups.values() if g is not None}.values()]
    active = [g for g in active if torch.distributed.get_world_size(g) > 1]
    if not active:
        return local_ok
    group = active[0] if len(active) == 1 else None
    flag = torch.tensor([0 if local_ok else 1], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return not bool(flag.item())


def param_info(
    param: Tensor, tp_size: int, qkv_split: Optional[Sequence[int]]
) -> MegatronMuonParamInfo:
    """TP-global info of a 2-D param: the local shape times TP on its ``partition_dim``.

    Args:
        param: a 2-D model param (Megatron's TP attributes where TP-sharded).
        tp_size: the size of its (expert) TP group.
        qkv_split: row counts of one query group's Q/K/V blocks, or None.

    Returns:
        Its ``MegatronMuonParamInfo``.
    """
    if param.ndim != 2:
        raise ValueError(
            f"Muon only takes 2-D parameters, got shape {tuple(param.shape)}; give it to an "
            "AdamW optimizer (or a use_muon=False group of Muon)"
        )
    shape = list(param.shape)
    dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", 0) else -1
    if dim in (0, 1):
        shape[dim] *= tp_size
    return MegatronMuonParamInfo(
        (shape[0], shape[1]),
        None if qkv_split is None else tuple(qkv_split),
        partition_dim=dim if dim in (0, 1) else None,
        expert=is_expert_param(param),
    )


def qkv_split_rows(model_config) -> tuple[int, int, int]:
    """Rows of Q, K, V in one query group of ``linear_qkv.weight`` (GQA: heads per group)."""
    heads_per_group = model_config.num_attention_heads // model_config.num_query_groups
    kv = model_config.kv_channels
    return (heads_per_group * kv, kv, kv)


def _check_qkv_layout(model_config, tp_mode: str, tp: int) -> None:
    """ValueError where ``linear_qkv.weight`` cannot be split per Q/K/V block: an attention
    output gate, or a TP shard holding part of a query group (outside the ``duplicated`` mode)."""
    if getattr(model_config, "attention_output_gate", False):
        raise ValueError(
            "TransformerConfig.attention_output_gate=True with optimizer='muon' and "
            "muon_split_qkv=True: each query group's rows are [q; gate; k; v], which Muon's "
            "Q/K/V split does not know; set muon_split_qkv=False"
        )
    groups = model_config.num_query_groups or model_config.num_attention_heads
    if groups < tp and tp_mode not in ("duplicated", "owner"):
        raise ValueError(
            f"TransformerConfig.num_query_groups={groups} < tensor_model_parallel_size={tp} "
            f"with muon_split_qkv=True and muon_tp_mode={tp_mode!r}: a TP shard of QKV holds "
            "part of a query group, which only muon_tp_mode='duplicated' or 'owner' split per "
            "block (or set muon_split_qkv=False)"
        )


def muon_param_infos(config, model_chunks, pg_collection=None) -> dict:
    """The info of every Muon param of the model chunks (QKV split: docs/tp_modes.md).

    Args:
        config: the ``OptimizerConfig``.
        model_chunks: the model chunks.
        pg_collection: the process groups, or None for ``parallel_state``'s.

    Returns:
        {model param: its ``MegatronMuonParamInfo``}.
    """
    groups = tp_groups(pg_collection)
    sizes = {k: torch.distributed.get_world_size(g) if g else 1 for k, g in groups.items()}
    infos = {}
    for chunk in model_chunks:
        if config.muon_split_qkv:
            _check_qkv_layout(chunk.config, config.muon_tp_mode, sizes[False])
        split = qkv_split_rows(chunk.config) if config.muon_split_qkv else None
        for name, param in chunk.named_parameters():
            if _is_muon_param(param, name):
                qkv = split if name.endswith("linear_qkv.weight") else None
                local = getattr(param, "orig_param", param)  # Megatron-FSDP: TP-local param
                infos[param] = param_info(local, sizes[is_expert_param(param)], qkv)
    return infos


def _split_param_groups(param_groups: list[dict], muon_params) -> list[dict]:
    """Each group -> a Muon half (``use_muon``) and an AdamW half, both kept even when empty:
    every rank keeps the same group structure (Megatron aligns groups for checkpoints)."""
    out = []
    for group in param_groups:
        for use_muon in (True, False):
            params = [p for p in group["params"] if (p in muon_params) == use_muon]
            out.append({**group, "params": params, "use_muon": use_muon})
    return out


def check_muon_supported(config, model_chunks) -> None:
    """ValueError naming the field and what is allowed, for what this Muon does not support.

    Args:
        config: the ``OptimizerConfig``; checked only if it asks for this Muon.
        model_chunks: the DDP-wrapped model chunks.
    """
    if not is_megatron_muon(config):
        return
    validate_muon_config(config)
    if any(getattr(c.ddp_config, "use_megatron_fsdp", False) for c in model_chunks):
        from .fsdp import check_megatron_fsdp  # ZeRO-3: docs/fsdp.md, "Muon"

        check_megatron_fsdp(config, model_chunks)
    check_experts_apart(model_chunks)


def check_experts_apart(model_chunks) -> None:
    """ValueError where one param holds all local experts (``moe_single_grouped_weight``):
    its Newton-Schulz would mix the experts and depend on EP."""
    configs = [getattr(c, "config", None) for c in model_chunks]
    if any(getattr(cfg, "moe_single_grouped_weight", False) for cfg in configs):
        raise ValueError(
            "optimizer='muon' with moe_single_grouped_weight=True: one param holds all local "
            "experts, which Muon would orthogonalize together; keep one weight per expert"
        )


def muon_kwargs(config) -> dict:
    """Muon's settings from OptimizerConfig (its AdamW half takes Megatron's Adam settings)."""
    return dict(
        lr=config.lr,
        weight_decay=config.weight_decay,
        momentum=config.muon_momentum,
        nesterov=config.muon_nesterov,
        ns_steps=config.muon_num_ns_steps,
        ns_coefficients=config.muon_coefficient_type,
        ns_precision=config.muon_fp32_matmul_prec,
        ns_form=config.muon_ns_form,
        matched_adamw_rms=config.muon_matched_adamw_rms,
        scale_mode=config.muon_scale_mode,
        extra_scale_factor=config.muon_extra_scale_factor,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        # Megatron's wrappers own non-finite handling (the fp16 grad scaler skips the step
        # before Muon runs; NaN checks live in DDP), exactly as for Adam
        on_nonfinite_grad="ignore",
    )


def build_muon(config, model_chunks, param_groups: list[dict], pg_collection=None):
    """The inner optimizer and its ``init_state_fn``, for the patched factory.

    Args:
        config: the ``OptimizerConfig``.
        model_chunks: the model chunks whose params the groups hold.
        param_groups: Megatron's param groups, each split here into a Muon and an AdamW half.
        pg_collection: the process groups, or None for ``parallel_state``'s.

    Returns:
        (``MegatronMuon``, its init_state_fn).
    """
    infos = muon_param_infos(config, model_chunks, pg_collection)
    optimizer = MegatronMuon(
        _split_param_groups(param_groups, infos),
        distopt_exchange_dtype=config.muon_distopt_exchange_dtype,
        distopt_plan_links=PlanLinks(
            config.muon_plan_tflops,
            config.muon_plan_dp_link_gbps,
            config.muon_plan_nvlink_gbps,
            config.muon_plan_nvlink_domain,
            config.muon_plan_min_efficiency,
        ),
        param_info=infos,
        orthogonalizer=TPOrthogonalizer(
            config.muon_tp_mode,
            tp_groups(pg_collection),
            timers=config.timers,
            replicas=dp_groups(pg_collection) if config.muon_tp_mode == "owner" else None,
        ),
        **muon_kwargs(config),
    )
    if _uses_torch_fsdp2(model_chunks, infos):  # ZeRO-3 params: fsdp.py
        from .fsdp import attach_fsdp2

        names = {p: n for chunk in model_chunks for n, p in chunk.named_parameters()}
        # Megatron's optimizer wrappers step fp32 (main) params whatever the model's dtype
        attach_fsdp2(optimizer, names, optimizer.distopt_exchange_dtype,
                     optimizer.distopt_plan_links, update_dtype=torch.float32)  # fmt: skip
    return optimizer, _init_muon_state


def _uses_torch_fsdp2(model_chunks, infos: dict) -> bool:
    """Whether the Muon params are torch FSDP2 DTensors (Megatron-FSDP's attach elsewhere)."""
    from torch.distributed.tensor import DTensor

    configs = [getattr(c, "ddp_config", None) for c in model_chunks]
    megatron_fsdp = any(getattr(c, "use_megatron_fsdp", False) for c in configs)
    return not megatron_fsdp and any(isinstance(p, DTensor) for p in infos)


def _init_muon_state(optimizer, config=None) -> None:
    """Megatron's ``init_state_fn``: every param's state, which checkpoint loading needs."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.init_state(param)


class _PositionalInfo(dict):
    """``Muon.param_info`` by position in the groups: Megatron's fp16 wrapper swaps each
    16-bit param for its fp32 main param after the optimizer is built."""

    def __init__(self, optimizer: "MegatronMuon") -> None:
        super().__init__()
        self.optimizer = optimizer

    def _refresh(self) -> None:
        for group, infos in zip(self.optimizer.param_groups, self.optimizer.group_infos):
            self.update(zip(group["params"], infos))

    def __missing__(self, param: Tensor) -> MuonParamInfo:
        self._refresh()
        if not dict.__contains__(self, param):
            raise KeyError(f"not a Muon param: shape {tuple(param.shape)}")
        return dict.__getitem__(self, param)

    def __contains__(self, param: object) -> bool:
        if not dict.__contains__(self, param):
            self._refresh()
        return dict.__contains__(self, param)


class MegatronMuon(Muon):
    """``Muon`` inside Megatron's wrappers, with the DistOpt exchange's dtype and planner machine
    (``distopt_*``, for distrib_optimizer.py's ``attach``)."""

    def __init__(
        self,
        params,
        distopt_exchange_dtype: str = "fp32",
        distopt_plan_links: PlanLinks = DEFAULT_LINKS,
        **kwargs,
    ) -> None:
        assert distopt_exchange_dtype in EXCHANGE_DTYPES, "validate_muon_config checks it"
        self.distopt_exchange_dtype = distopt_exchange_dtype
        self.distopt_plan_links = distopt_plan_links
        self.group_infos: list[list[MuonParamInfo]] = []
        super().__init__(params, **kwargs)
        built = self.param_info
        self.param_info = _PositionalInfo(self)
        self.param_info.update(built)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``Muon.add_param_group``, remembering the group's infos by position."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        muon = group["use_muon"]
        self.group_infos.append([self.param_info[p] for p in group["params"]] if muon else [])


class TensorParallelMuon(Muon):
    """Upstream's constructor (megatron-core 0.19's arguments) on our Muon; every param is a
    Muon param. How the arguments map, and why the updates equal upstream's: docs/muon.md."""

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-4,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.01,
        use_decoupled_weight_decay: bool = True,
        split_qkv: bool = False,
        is_qkv_fn: Callable[[torch.Tensor], bool] | None = None,
        qkv_split_shapes: tuple[int, int, int] | None = None,
        fp32_matmul_prec: str = "medium",
        coefficient_type: str = "quintic",
        num_ns_steps: int = 5,
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        pg_collection: Optional[Any] = None,
        tp_mode: Literal["blockwise", "duplicated", "distributed"] = "duplicated",
        on_nonfinite_grad: Literal["raise", "skip", "ignore"] = "ignore",  # opt-in: a TP sync
    ) -> None:
        mode = tp_mode
        check_choice("tp_mode", mode, TP_MODES)
        if num_ns_steps < 1:  # upstream's words for upstream's argument
            raise ValueError(f"num_ns_steps must be at least 1, got {num_ns_steps}")
        if split_qkv and (is_qkv_fn is None or qkv_split_shapes is None):
            raise ValueError("split_qkv=True needs is_qkv_fn and qkv_split_shapes")
        params = list(params)
        groups = _tp_groups(pg_collection)
        infos = _tp_infos(params, groups, qkv_split_shapes if split_qkv else None, is_qkv_fn)
        self.pg_collection = pg_collection
        self._tp_group_map = groups
        self.mode = mode
        self.split_qkv = split_qkv
        self.is_qkv_fn = is_qkv_fn
        self.qkv_split_shapes = qkv_split_shapes
        super().__init__(
            params,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=num_ns_steps,
            ns_coefficients=coefficient_type,
            ns_precision=fp32_matmul_prec,
            matched_adamw_rms=None,
            scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor,
            decoupled_weight_decay=use_decoupled_weight_decay,
            param_info=infos,
            orthogonalizer=TPOrthogonalizer(mode, groups),
            on_nonfinite_grad=on_nonfinite_grad,
        )

    def _agree(self, local_ok: bool) -> bool:
        """One all-reduce so that all TP peers raise or skip together: a rank that raised
        alone would leave its peers waiting in the TP all-gather."""
        params = [p for g in self.param_groups for p in g["params"]]
        return _agree_across(local_ok, self._tp_group_map, params[0].device if params else None)


def _tp_groups(pg_collection: Optional[Any]) -> dict:
    if pg_collection is None and not parallel_state.model_parallel_is_initialized():
        return {False: None, True: None}
    return tp_groups(pg_collection)


def _tp_infos(params: list, groups: dict, qkv_split, is_qkv_fn) -> dict:
    """TP-global info (shape, partition dim, QKV blocks) of every param."""
    infos = {}
    for p in _iter_params(params):
        split = qkv_split if qkv_split is not None and is_qkv_fn(p) else None
        infos[p] = param_info(p, get_pg_size(groups[is_expert_param(p)]), split)
    return infos


def _iter_params(params: list) -> Iterable[Tensor]:
    for item in params:
        yield from item["params"] if isinstance(item, dict) else [item]
