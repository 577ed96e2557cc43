"""Megatron's DistributedOptimizer (ZeRO-1) with ``MegatronMuon`` inside
(``muon_impl='megatron_muon'``, patch 0002): adds the exchange plan (built here, run by
exchange.py), DDP's buffer layout (layout.py) and Muon's state in every DistOpt
checkpoint format (checkpoint*.py); docs/distopt_exchange.md.
"""

import dataclasses
import logging
from typing import Optional

from megatron.core.utils import log_single_rank

from ..distrib_optimizer import DistributedOptimizer
from ..repairs.distopt_layout import in_bucket, param_name
from . import checkpoint, layout
from . import checkpoint_sharded as sharded
from .config import is_megatron_muon
from .exchange import (
    BucketSlot,
    DistributedMuonOrthogonalizer,
    MatrixSlot,
    ShardInfo,
)
from .planner import figures as plan_figures
from .planner.cost_model import DEFAULT_LINKS, NSCostModel, PlanLinks
from .planner.gangs import GangRunner, gang_nodes
from .planner.plan import MuonExchangePlan, exchange_cost_model
from .tp import owners_orthogonalizer

logger = logging.getLogger(__name__)


class MuonDistributedOptimizer(DistributedOptimizer):
    """``DistributedOptimizer`` with a ``MegatronMuon`` inside: exact Muon, DP-sharded."""

    @classmethod
    def _serves_config(cls, config) -> bool:  # DistributedOptimizer(...) builds this class
        return is_megatron_muon(config)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        muon = self.optimizer
        if self.ddp_config.use_megatron_fsdp:  # ZeRO-3: fsdp.py
            from .fsdp import attach_megatron_fsdp

            links = muon.distopt_plan_links
            attach_megatron_fsdp(muon, muon.distopt_exchange_dtype, links)
            return
        attach(self, muon, muon.distopt_exchange_dtype, links=muon.distopt_plan_links)
        aligned = any(layout.is_shard_aligned(b) for b in self.buffers)
        kind = "shard-aligned" if aligned else "byte-level"
        log_single_rank(logger, logging.INFO, plan_figures.summary(self.muon_plan, kind))

    # DDP's buffer layout for this optimizer (upstream's static method, same signature): the Muon
    # matrices shard-aligned where their holders' Newton-Schulz loads balance, else DistOpt's
    compute_full_param_layout = staticmethod(layout.compute_full_param_layout)

    def start_param_sync_for_bucket_group_subset(self) -> None:
        """Start every bucket group's param all-gather, shard-aligned Muon buffers included."""
        for chunk in self.model_chunks:
            for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                if group.buckets:
                    chunk._start_bucket_group_param_sync(group, force_sync=False)

    def state_dict(self):
        """Param groups, grad scaler and format marker (checkpoint.py); under Megatron-FSDP
        upstream's (its fsdp_dtensor checkpoints name every param's state: fsdp.py)."""
        if self.ddp_config.use_megatron_fsdp:
            return super().state_dict()
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict):
        """Load any format this class saves; another optimizer's is refused by name."""
        if self.ddp_config.use_megatron_fsdp:  # fsdp_dtensor: groups by param name (fsdp.py)
            from .fsdp import groups_by_name

            return super().load_state_dict(groups_by_name(self, state_dict))
        sharded.load_state_dict(self, state_dict)

    def get_parameter_state_dp_zero(
        self, use_gloo_comm: bool = True, empty_data: bool = False, return_on_all_ranks=False
    ):
        """Every param's main param and state by name (``torch`` format; checkpoint.py).

        Args:
            use_gloo_comm: unused (the DP group's gloo twin is used where there is one).
            empty_data: unused (the state is always gathered).
            return_on_all_ranks: gather to every DP rank, not DP rank 0 only.

        Returns:
            The state on the receivers, else None.
        """
        return checkpoint.get_parameter_state_dp_zero(self, return_on_all_ranks)

    def load_parameter_state_from_dp_zero(self, state_dict, *, update_legacy_format=False):
        """Scatter a ``torch``-format param state to the shards.

        Args:
            state_dict: ``get_parameter_state_dp_zero``'s output.
            update_legacy_format: unused (no legacy version).
        """
        checkpoint.scatter_state(self, state_dict)

    def sharded_param_state_fully_reshardable(
        self, model_sharded_state_dict, is_loading: bool = False, metadata=None
    ):
        """``torch_dist`` fully reshardable param state: model-space tensors by name.

        Args:
            model_sharded_state_dict: the model's sharded state dict.
            is_loading: build the placeholders a load fills.
            metadata: unused.

        Returns:
            The sharded param state.
        """
        return sharded.sharded_fully_reshardable(self, model_sharded_state_dict, is_loading)

    def sharded_param_state_dp_reshardable(
        self, model_sharded_state_dict, is_loading: bool = False, metadata=None
    ):
        """``torch_dist`` DP-reshardable param state: one flat tensor per param and key.

        Args:
            model_sharded_state_dict: the model's sharded state dict.
            is_loading: build the placeholders a load fills.
            metadata: unused.

        Returns:
            The sharded param state.
        """
        return sharded.sharded_dp_reshardable(self, model_sharded_state_dict, is_loading)

    def sharded_param_state_fs_model_space(
        self, model_sharded_state_dict, is_loading: bool = False, metadata=None
    ):
        """NotImplementedError: no ``fully_sharded_model_space`` format of Muon's state.

        Args:
            model_sharded_state_dict: unused.
            is_loading: unused.
            metadata: unused.
        """
        checkpoint.unsupported_format(self, "fully_sharded_model_space")


# ------------------------------------------------------------------ the exchange, at construction


def build_plan(distopt, tp_info_of, model: NSCostModel, window=None) -> MuonExchangePlan:
    """The exchange plan from DistOpt's range maps; the same on every rank (bucket layouts are).

    Args:
        distopt: the ``DistributedOptimizer``.
        tp_info_of: model param -> TP-global ``MuonParamInfo``, or None for AdamW params.
        model: the Newton-Schulz cost model.
        window: Muon elements per exchange; None: one exchange per DP group.

    Returns:
        This DP rank's ``MuonExchangePlan``.
    """
    buckets, matrices = [], []
    for buffer in distopt.buffers:
        for bucket in buffer.buckets:
            group = buffer.data_parallel_group
            slot = BucketSlot(group=group, shard_size=bucket.grad_data.numel() // group.size())
            for param in bucket.params_list:
                info = tp_info_of(param)
                if info is None:
                    continue
                start, end = in_bucket(buffer, bucket, param)
                slot.matrices.append(len(matrices))
                matrices.append(
                    MatrixSlot(
                        name=param_name(distopt, param),
                        bucket=len(buckets),
                        start=start,
                        end=end,
                        local_shape=tuple(param.shape),
                        info=info,
                        cost=model.whole(info),
                    )
                )
            slot.matrices.sort(key=lambda i: matrices[i].start)
            buckets.append(slot)
    group = buckets[0].group if buckets else None
    rank, world = (group.rank(), group.size()) if group is not None else (0, 1)
    return MuonExchangePlan(buckets, matrices, rank, world, window, model)


def _shard_infos(distopt, plan: MuonExchangePlan, muon_params: set) -> dict:
    """{shard main param: ShardInfo} for the Muon params among DistOpt's shards."""
    index = {slot.name: i for i, slot in enumerate(plan.matrices)}
    out = {}
    for param, (gi, order) in distopt.model_param_group_index_map.items():
        if param not in muon_params:
            continue
        shard = distopt.optimizer.param_groups[gi]["params"][order]
        i = index[param_name(distopt, param)]
        info = plan.matrices[i].info
        offset = distopt._get_model_param_range_map(param)["param"].start
        out[shard] = ShardInfo(info.shape, info.qkv_split, i, offset)
    return out


def attach(
    distopt,
    muon,
    exchange_dtype: str = "fp32",
    window: Optional[int] = None,
    links: PlanLinks = DEFAULT_LINKS,
) -> None:
    """Make ``muon`` (DistOpt's inner optimizer) step DP-sharded params exactly: once, after DistOpt
    replaced its params by 1-D shards, ``param_info`` is remapped to ``ShardInfo``s and the
    orthogonalizer wrapped in the exchange.

    Args:
        distopt: the ``DistributedOptimizer`` being built.
        muon: its inner Muon optimizer; modified in place.
        exchange_dtype: the exchange's dtype where NS does not set it (``exchange_dtypes``).
        window: Muon elements per exchange; None: one exchange per DP group.
        links: the machine the planner assumes (``PlanLinks``, planner/cost_model.py).
    """
    model, ns_dtype = exchange_cost_model(
        muon, exchange_dtype, links, "with use_distributed_optimizer"
    )
    muon_params = {p for p in distopt.model_param_group_index_map if muon.param_info.get(p)}
    infos = [muon.param_info[p] for p in muon_params]
    if distopt.buffers:  # where gangs may ring
        group = distopt.buffers[0].data_parallel_group
        nodes = gang_nodes(group, links.nvlink_domain, muon.orthogonalizer, infos)
        model = dataclasses.replace(model, nodes=nodes)
    plan = build_plan(distopt, muon.param_info.get, model, window)
    muon.param_info = _shard_infos(distopt, plan, muon_params)
    device = distopt.buffers[0].grad_data.device if distopt.buffers else None
    gangs = GangRunner(muon.orthogonalizer)  # the TP one: gang blocks share TP
    gangs.make_groups(plan)
    muon.orthogonalizer = DistributedMuonOrthogonalizer(
        plan,
        owners_orthogonalizer(muon.orthogonalizer, infos),
        exchange_dtype,
        ns_dtype,
        device=device,
        gangs=gangs,
    )
    # A per-rank raise on a non-finite grad would leave the other DP ranks waiting in the
    # exchange; Megatron's own checks (grad scaler found_inf, DDP's NaN check) are collective.
    muon.on_nonfinite_grad = "ignore"
    distopt.muon_plan = plan
