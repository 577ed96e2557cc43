"""Muon inside Megatron: which params take Muon, their groups, and the optimizer factory.

``get_megatron_optimizer(OptimizerConfig(optimizer='muon', ...), model_chunks)`` runs upstream's
own machinery unchanged (``_get_param_groups`` with wd/lr multipliers, decoupled lr and
``config_overrides``; dense and expert optimizers; the fp16/bf16/fp32 wrappers with fp32 main
params, grad scaler, clipping and grad norm; ``ChainedOptimizer``). Patch
``0002-optimizer-factory-muon.patch`` adds two calls into this module:

* ``check_muon_supported`` at the top of ``get_megatron_optimizer``: a ``ValueError`` for the
  combinations not supported yet, on every rank (also ranks without params);
* ``build_muon`` where upstream builds its Adam/SGD: one ``MegatronMuon`` per Megatron optimizer
  whose groups are Megatron's groups, each split into a Muon half (``use_muon=True``: 2-D weights
  that are not embeddings or the output layer, expert weights included) and an AdamW half.

Tensor parallelism lives in ``muon_tp.py`` (the orthogonalizers); the math in ``muon.py``.
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from megatron.core import parallel_state

from .muon import Muon
from .muon_functional import MuonParamInfo
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


def is_muon_param(param: Tensor) -> bool:
    """Muon takes 2-D weights except the embedding and output layer (also expert weights)."""
    return param.ndim == 2 and not getattr(param, "is_embedding_or_output_parameter", False)


def is_expert_param(param: Tensor) -> bool:
    # Megatron marks expert-parallel params with allreduce=False (DDP, _get_param_groups)
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
    """Global info of a (possibly TP-sharded) 2-D param: the local shape times TP on its dim."""
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


def muon_param_infos(config, model_chunks, pg_collection=None) -> dict:
    """{param: MegatronMuonParamInfo} for every Muon param of the model chunks.

    QKV: with ``muon_split_qkv`` a 2-D ``linear_qkv.weight`` is orthogonalized per Q/K/V block.
    TP splits its rows by whole query groups, so the global matrix is the row concatenation of
    the shards in TP-rank order: exact TP modes see the TP=1 layout. (Each Q block spans all
    query groups, hence all TP ranks: splitting does not make the exchange unnecessary.)
    """
    groups = tp_groups(pg_collection)
    sizes = {k: torch.distributed.get_world_size(g) if g else 1 for k, g in groups.items()}
    infos = {}
    for chunk in model_chunks:
        split = qkv_split_rows(chunk.config) if config.muon_split_qkv else None
        for name, param in chunk.named_parameters():
            if is_muon_param(param):
                qkv = split if name.endswith("linear_qkv.weight") else None
                infos[param] = param_info(param, sizes[is_expert_param(param)], qkv)
    return infos


def split_param_groups(param_groups: list[dict]) -> list[dict]:
    """Each Megatron group -> a Muon half and an AdamW half, same settings otherwise.

    Both halves are kept even when empty, so every rank has the same group structure (Megatron
    aligns groups across ranks for checkpoints).
    """
    out = []
    for group in param_groups:
        for use_muon in (True, False):
            params = [p for p in group["params"] if is_muon_param(p) == use_muon]
            out.append({**group, "params": params, "use_muon": use_muon})
    return out


def check_muon_supported(config, model_chunks) -> None:
    """ValueError for what Muon does not support yet (never a silent fallback)."""
    if config.optimizer != "muon":
        return
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


def muon_kwargs(config) -> dict:
    """Muon's settings from OptimizerConfig (its AdamW half takes Megatron's Adam settings)."""
    return dict(
        lr=config.lr,
        weight_decay=config.weight_decay,
        momentum=config.muon_momentum,
        nesterov=config.muon_use_nesterov,
        ns_steps=config.muon_num_ns_steps,
        ns_coefficients=config.muon_coefficient_type,
        ns_precision=config.muon_fp32_matmul_prec,
        matched_adamw_rms=config.muon_matched_adamw_rms,
        scale_mode=config.muon_scale_mode,
        extra_scale_factor=config.muon_extra_scale_factor,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        # Megatron's wrappers own non-finite handling (the fp16 grad scaler skips the step
        # before Muon runs; NaN checks live in DDP), exactly as for Adam
        on_nonfinite_grad="ignore",
        distopt_exchange_dtype=config.muon_distopt_exchange_dtype,
    )


def build_muon(config, model_chunks, param_groups: list[dict], pg_collection=None):
    """(inner optimizer, init_state_fn) for upstream's wrappers; called by the patched factory."""
    infos = muon_param_infos(config, model_chunks, pg_collection)
    optimizer = MegatronMuon(
        split_param_groups(param_groups),
        param_info=infos,
        orthogonalizer=TPOrthogonalizer(config.muon_tp_mode, tp_groups(pg_collection)),
        **muon_kwargs(config),
    )
    return optimizer, init_muon_state


def init_muon_state(optimizer, config=None) -> None:
    """Megatron's ``init_state_fn``: create every param's state (checkpoint loading needs it)."""
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
    """``Muon`` whose per-param infos follow the fp32 main-param swap (``_PositionalInfo``)."""

    def __init__(self, params, **kwargs) -> None:
        self.group_infos: list[list[MuonParamInfo]] = []
        super().__init__(params, **kwargs)
        built = self.param_info
        self.param_info = _PositionalInfo(self)
        self.param_info.update(built)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        muon = group["use_muon"]
        self.group_infos.append([self.param_info[p] for p in group["params"]] if muon else [])


def get_megatron_muon_optimizer(
    config,
    model_chunks,
    config_overrides=None,
    use_gloo_process_groups: bool = True,
    layer_wise_distributed_optimizer: bool = False,
    pg_collection=None,
):
    """Upstream 0.16.1's Muon entry point (same parameters), on ``get_megatron_optimizer``.

    Returns the same optimizer as ``get_megatron_optimizer(config, ...)`` with
    ``config.optimizer='muon'`` (a copy of ``config`` is made if it names another optimizer;
    upstream instead mutated it to 'adam'). Unlike upstream, Muon and AdamW params share one
    optimizer per dense/expert part, and fp16 is supported.
    """
    if layer_wise_distributed_optimizer:
        raise ValueError(
            "get_megatron_muon_optimizer(layer_wise_distributed_optimizer=True) is not "
            "supported: use the distributed optimizer integration (use_distributed_optimizer)"
        )
    from . import get_megatron_optimizer  # the package imports this module: import late

    if config.optimizer != "muon":
        config = dataclasses.replace(config, optimizer="muon")
    return get_megatron_optimizer(
        config,
        model_chunks,
        config_overrides=config_overrides,
        use_gloo_process_groups=use_gloo_process_groups,
        pg_collection=pg_collection,
    )
