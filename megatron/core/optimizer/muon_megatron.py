"""Muon inside Megatron: which params take Muon, their groups, and the optimizer factory.

Upstream's ``get_megatron_optimizer`` machinery runs unchanged; patch 0002 calls
``check_muon_supported`` (refusals, on every rank) and ``build_muon`` (one ``MegatronMuon`` per
Megatron optimizer, each group split into a Muon and an AdamW half) from it. Also upstream's
``TensorParallelMuon`` constructor. Map of the modules: docs/muon_in_megatron.md.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from .. import parallel_state
from ..utils import get_pg_size
from .muon_config import (
    EXCHANGE_DTYPES,
    TP_MODES,
    is_megatron_muon,
    validate_muon_config,
)
from .muon_functional import MuonParamInfo
from .muon_optimizer import Muon
from .muon_split import DEFAULT_LINKS, PlanLinks
from .muon_tp import TPOrthogonalizer


@dataclass(frozen=True)
class MegatronMuonParamInfo(MuonParamInfo):
    """``MuonParamInfo`` (global shape, QKV split) plus how the param is sharded over TP.

    ``partition_dim`` is Megatron's ``param.partition_dim`` (0: rows of W = outputs, a
    ColumnParallelLinear; 1: columns, a RowParallelLinear), None for a param TP does not split.
    ``expert`` selects the expert-TP group instead of the TP group.
    """

    partition_dim: Optional[int] = None
    expert: bool = False


def is_muon_param(param: Tensor, name: str = "") -> bool:
    """Muon takes 2-D weights (expert weights too) except embeddings and the output layer: the
    word embeddings and output layer Megatron marks, and learned absolute position embeddings
    (``name``), which it does not mark.

    Args:
        param: a model param.
        name: its name in the model chunk (``named_parameters``).

    Returns:
        True where Muon steps it, False where AdamW does.
    """
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


def agree_across(local_ok: bool, groups: dict, device=None) -> bool:
    """True iff ``local_ok`` holds on every rank of the given TP groups ({expert?: group}).

    Both groups of size > 1 and different: one all-reduce over all ranks (Megatron steps every
    rank's optimizer together), so that no chain of overlapping groups can disagree.

    Args:
        local_ok: this rank's verdict.
        groups: {expert?: TP process group} (``tp_groups``); None or size-1 groups are skipped.
        device: where the flag tensor lives (the NCCL device on GPU); None: the default.

    Returns:
        The same verdict on every rank: True only if every rank's ``local_ok`` is.
    """
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
    """Global info of a (possibly TP-sharded) 2-D param: the local shape times TP on its dim.

    Args:
        param: a 2-D model param, with Megatron's ``partition_dim`` attributes where TP-sharded.
        tp_size: the size of its TP group (the expert TP group for an expert param).
        qkv_split: row counts of one query group's Q/K/V blocks, or None.

    Returns:
        Its ``MegatronMuonParamInfo`` (TP-global shape, partition_dim, expert).
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


def check_qkv_layout(model_config, tp_mode: str, tp: int) -> None:
    """ValueError where ``muon_split_qkv`` cannot split ``linear_qkv.weight`` per Q/K/V block:
    with ``attention_output_gate`` a query group's rows are ``[q; gate; k; v]``, which
    ``qkv_split_rows`` does not describe; with fewer query groups than TP ranks a TP shard
    holds part of a query group, which only the ``duplicated`` mode (it gathers the matrix)
    can split.

    Args:
        model_config: the model's ``TransformerConfig``.
        tp_mode: ``OptimizerConfig.muon_tp_mode``.
        tp: the tensor-parallel size.

    Raises:
        ValueError: naming the model setting and the ways out.
    """
    if getattr(model_config, "attention_output_gate", False):
        raise ValueError(
            "TransformerConfig.attention_output_gate=True with optimizer='muon' and "
            "muon_split_qkv=True: each query group's rows are [q; gate; k; v], which Muon's "
            "Q/K/V split does not know; set muon_split_qkv=False"
        )
    groups = model_config.num_query_groups or model_config.num_attention_heads
    if groups < tp and tp_mode != "duplicated":
        raise ValueError(
            f"TransformerConfig.num_query_groups={groups} < tensor_model_parallel_size={tp} "
            f"with muon_split_qkv=True and muon_tp_mode={tp_mode!r}: a TP shard of QKV holds "
            "part of a query group, which only muon_tp_mode='duplicated' splits per block (or "
            "set muon_split_qkv=False)"
        )


def muon_param_infos(config, model_chunks, pg_collection=None) -> dict:
    """{param: MegatronMuonParamInfo} for every Muon param of the model chunks.

    QKV: with ``muon_split_qkv`` a 2-D ``linear_qkv.weight`` is orthogonalized per Q/K/V block.
    TP splits its rows by whole query groups, so the global matrix is the row concatenation of
    the shards in TP-rank order: exact TP modes see the TP=1 layout. (Each Q block spans all
    query groups, hence all TP ranks: splitting does not make the exchange unnecessary.)

    Args:
        config: the ``OptimizerConfig`` (``muon_split_qkv``).
        model_chunks: the model chunks (one per virtual pipeline stage).
        pg_collection: the process groups, or None for ``parallel_state``'s.

    Returns:
        {model param: its ``MegatronMuonParamInfo``}.
    """
    groups = tp_groups(pg_collection)
    sizes = {k: torch.distributed.get_world_size(g) if g else 1 for k, g in groups.items()}
    infos = {}
    for chunk in model_chunks:
        if config.muon_split_qkv:
            check_qkv_layout(chunk.config, config.muon_tp_mode, sizes[False])
        split = qkv_split_rows(chunk.config) if config.muon_split_qkv else None
        for name, param in chunk.named_parameters():
            if is_muon_param(param, name):
                qkv = split if name.endswith("linear_qkv.weight") else None
                infos[param] = param_info(param, sizes[is_expert_param(param)], qkv)
    return infos


def split_param_groups(param_groups: list[dict], muon_params) -> list[dict]:
    """Each Megatron group -> a Muon half (its params in ``muon_params``) and an AdamW half,
    same settings otherwise.

    Both halves are kept even when empty, so every rank has the same group structure (Megatron
    aligns groups across ranks for checkpoints).

    Args:
        param_groups: Megatron's param groups (``_get_param_groups``).
        muon_params: the params Muon steps (``muon_param_infos``' keys).

    Returns:
        Two groups per Megatron group, ``use_muon`` True then False.
    """
    out = []
    for group in param_groups:
        for use_muon in (True, False):
            params = [p for p in group["params"] if (p in muon_params) == use_muon]
            out.append({**group, "params": params, "use_muon": use_muon})
    return out


def check_muon_supported(config, model_chunks) -> None:
    """Validate a Muon config where Muon is built; ValueError for what Muon does not support.

    Args:
        config: the ``OptimizerConfig``; nothing is checked unless it asks for this Muon
            (``is_megatron_muon``: ``optimizer == 'muon'``, and ``muon_impl='megatron_muon'``
            where upstream has its own Muon).
        model_chunks: the DDP-wrapped model chunks.

    Raises:
        ValueError: naming the field, its value and what is allowed (never a silent fallback).
    """
    if not is_megatron_muon(config):
        return
    validate_muon_config(config)
    _check_not_upstream_muon_only(config)
    unsupported = {
        "optimizer_cpu_offload": "Muon has no CPU-offloaded (HybridDeviceOptimizer) variant",
        "use_precision_aware_optimizer": "Muon keeps its state in the main params' dtype",
    }
    for name, reason in unsupported.items():
        if getattr(config, name):
            raise ValueError(f"OptimizerConfig.{name}=True with optimizer='muon': {reason}")
    if not config.decoupled_weight_decay:
        raise ValueError(
            "OptimizerConfig.decoupled_weight_decay=False with optimizer='muon': Muon's AdamW "
            "params use decoupled weight decay only"
        )
    if any(getattr(c.ddp_config, "use_megatron_fsdp", False) for c in model_chunks):
        raise ValueError("DistributedDataParallelConfig.use_megatron_fsdp=True: not with Muon")
    check_experts_apart(model_chunks)


def _check_not_upstream_muon_only(config) -> None:
    """Refuse, by name, the settings of upstream's emerging-optimizers Muon that this Muon does
    not have."""
    refused = {
        "use_layer_wise_distributed_optimizer": (
            True,
            "upstream's LayerWise optimizer; this Muon shards inside the DistributedOptimizer "
            "(use_distributed_optimizer=True)",
        ),
        "optimizer_cuda_graph": (True, "no CUDA graph of this Muon's step"),
    }
    for name, (bad, reason) in refused.items():
        if getattr(config, name, None) == bad:
            raise ValueError(
                f"OptimizerConfig.{name}={bad} with muon_impl='megatron_muon': {reason}"
            )
    scalar = getattr(config, "muon_scalar_optimizer", "adam")
    if scalar != "adam":
        raise ValueError(
            f"OptimizerConfig.muon_scalar_optimizer={scalar!r} with muon_impl='megatron_muon': "
            "its non-matrix params use AdamW (allowed: 'adam')"
        )


def check_experts_apart(model_chunks) -> None:
    """ValueError where one param holds several experts' matrices: Muon orthogonalizes each
    expert's weight on its own (as over SequentialMLP in one process), but
    ``moe_single_grouped_weight`` keeps all local experts in one param, whose Newton-Schulz
    would mix the experts (and depend on EP).

    Args:
        model_chunks: the model chunks.

    Raises:
        ValueError: naming the module and the ways out.
    """
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
    """(inner optimizer, init_state_fn) for upstream's wrappers; called by the patched factory.

    Args:
        config: the ``OptimizerConfig`` (Muon and Adam settings).
        model_chunks: the model chunks whose params the groups hold.
        param_groups: Megatron's param groups (``_get_param_groups``), split here into Muon and
            AdamW halves.
        pg_collection: the process groups, or None for ``parallel_state``'s.

    Returns:
        (``MegatronMuon``, ``init_muon_state``).
    """
    infos = muon_param_infos(config, model_chunks, pg_collection)
    optimizer = MegatronMuon(
        split_param_groups(param_groups, infos),
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
            config.muon_tp_mode, tp_groups(pg_collection), timers=config.timers
        ),
        **muon_kwargs(config),
    )
    return optimizer, init_muon_state


def init_muon_state(optimizer, config=None) -> None:
    """Megatron's ``init_state_fn``: create every param's state (checkpoint loading needs it).

    Args:
        optimizer: the inner ``MegatronMuon``.
        config: the ``OptimizerConfig``; unused, part of upstream's signature.
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.init_state(param)


class _PositionalInfo(dict):
    """``Muon.param_info`` that survives Megatron swapping params inside the groups.

    ``Float16OptimizerWithFloat16Params`` replaces each bf16/fp16 param in the inner optimizer's
    groups by its fp32 main param *after* the optimizer is built; the info of a group's i-th
    param is that of whatever tensor now sits at position i.
    """

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
    """``Muon`` inside Megatron's optimizer wrappers and DistributedOptimizer.

    Its per-param infos follow the fp32 main-param swap (``_PositionalInfo``); under the
    DistributedOptimizer, ``MuonDistributedOptimizer`` attaches its shard layout and exchange.

    Args:
        params: param groups (``use_muon`` picks the rule), as for ``Muon``.
        distopt_exchange_dtype: dtype of the momentum exchanged over DP ranks ('fp32', 'bf16').
        distopt_plan_links: the machine the DistOpt planner assumes (``muon_split.PlanLinks``).
        **kwargs: ``Muon``'s settings.
    """

    def __init__(
        self,
        params,
        distopt_exchange_dtype: str = "fp32",
        distopt_plan_links: PlanLinks = DEFAULT_LINKS,
        **kwargs,
    ) -> None:
        if distopt_exchange_dtype not in EXCHANGE_DTYPES:
            raise ValueError(
                f"distopt_exchange_dtype must be one of {list(EXCHANGE_DTYPES)}, "
                f"got {distopt_exchange_dtype!r}"
            )
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
    """Upstream's constructor on our Muon (no emerging_optimizers): megatron-core 0.19's
    argument names and order, and 0.16.1's names for the same arguments (``momentum_beta``,
    ``use_nesterov``, ``mode``; keyword only; giving both names of one argument is an error).

    Every param here is a Muon param (upstream keeps AdamW in a separate optimizer). Upstream's
    names map as: ``momentum``, ``nesterov`` as is, ``fp32_matmul_prec`` -> ns_precision
    ('highest' fp32, 'high' TF32 allowed on CUDA, 'medium' bf16), ``coefficient_type`` ->
    ns_coefficients, ``num_ns_steps`` -> ns_steps, ``scale_mode`` and ``extra_scale_factor`` as
    is (matched_adamw_rms is None), ``use_decoupled_weight_decay=False`` -> L2 decay added to the
    gradient. ``split_qkv`` orthogonalizes params for which ``is_qkv_fn(p)`` holds per
    ``qkv_split_shapes`` block. Upstream's momentum buffer is an EMA, ``(1 - momentum)`` times
    ours; Newton-Schulz is scale invariant, so the updates are the same.

    Tensor parallelism (``muon_tp.py``): params carry Megatron's ``tensor_model_parallel`` and
    ``partition_dim``; ``duplicated`` and ``distributed`` are exact over ``pg_collection.tp``
    (``expt_tp`` for expert params), ``blockwise`` orthogonalizes each TP-local slice. Without a
    ``pg_collection``, Megatron's ``parallel_state`` groups are used when initialized, else TP=1.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 3e-4,
        momentum: Optional[float] = None,
        nesterov: Optional[bool] = None,
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
        tp_mode: Optional[Literal["blockwise", "duplicated", "distributed"]] = None,
        *,
        momentum_beta: Optional[float] = None,
        use_nesterov: Optional[bool] = None,
        mode: Optional[Literal["blockwise", "duplicated", "distributed"]] = None,
    ) -> None:
        momentum = _one_name("momentum", momentum, "momentum_beta", momentum_beta, 0.95)
        nesterov = _one_name("nesterov", nesterov, "use_nesterov", use_nesterov, True)
        mode = _one_name("tp_mode", tp_mode, "mode", mode, "duplicated")
        if mode not in TP_MODES:
            raise ValueError(f"mode must be one of {list(TP_MODES)}, got {mode!r}")
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
        )

    def _agree(self, local_ok: bool) -> bool:
        """One all-reduce so that all TP peers raise or skip together: a rank that raised
        alone would leave its peers waiting in the TP all-gather."""
        params = [p for g in self.param_groups for p in g["params"]]
        return agree_across(local_ok, self._tp_group_map, params[0].device if params else None)


def _one_name(name: str, value: Any, old_name: str, old_value: Any, default: Any) -> Any:
    """The value of an argument upstream named ``name`` (0.19) and ``old_name`` (0.16.1)."""
    if value is not None and old_value is not None:
        raise ValueError(
            f"TensorParallelMuon got both {name}={value!r} and {old_name}={old_value!r}: "
            f"give one ({old_name} is megatron-core 0.16.1's name for {name})"
        )
    if value is None:
        return default if old_value is None else old_value
    return value


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
