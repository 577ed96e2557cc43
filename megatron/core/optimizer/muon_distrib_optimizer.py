"""Megatron's DistributedOptimizer (ZeRO-1) with ``MegatronMuon`` inside, built by the factory
(patch 0002) for ``muon_impl='megatron_muon'``. On top of upstream's class: the exchange of whole
matrices (muon_distopt.py), DDP's buffer layout (muon_layout.py) and checkpoints of Muon's state
in every DistOpt format (muon_checkpoint.py, muon_checkpoint_sharded.py); docs/distopt_exchange.md.
"""

import logging

from megatron.core.utils import log_single_rank

from . import muon_checkpoint as checkpoint
from . import muon_checkpoint_sharded as sharded
from . import muon_layout
from . import muon_plan_figures as plan_figures
from .distrib_optimizer import DistributedOptimizer
from .muon_distopt import attach

logger = logging.getLogger(__name__)


class MuonDistributedOptimizer(DistributedOptimizer):
    """``DistributedOptimizer`` whose inner optimizer is a ``MegatronMuon``: exact Muon on DP
    shards. Args: those of ``DistributedOptimizer``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        muon = self.optimizer
        attach(self, muon, muon.distopt_exchange_dtype, links=muon.distopt_plan_links)
        aligned = any(muon_layout.is_shard_aligned(b) for b in self.buffers)
        layout = "shard-aligned" if aligned else "byte-level"
        log_single_rank(logger, logging.INFO, plan_figures.summary(self.muon_plan, layout))

    # DDP's buffer layout for this optimizer (upstream's static method, same signature): the Muon
    # matrices shard-aligned where their holders' Newton-Schulz loads balance, else DistOpt's
    compute_full_param_layout = staticmethod(muon_layout.compute_full_param_layout)

    def start_param_sync_for_bucket_group_subset(self) -> None:
        """Start every bucket group's param all-gather, the shard-aligned Muon buffers included
        (upstream's leaves those to a LayerWise sibling)."""
        for chunk in self.model_chunks:
            for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                if group.buckets:
                    chunk._start_bucket_group_param_sync(group, force_sync=False)

    def state_dict(self):
        """Param groups, grad scaler and format marker (muon_checkpoint.py)."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict):
        """Load any format this class saves; another optimizer's is refused by name."""
        sharded.load_state_dict(self, state_dict)

    def get_parameter_state_dp_zero(
        self, use_gloo_comm: bool = True, empty_data: bool = False, return_on_all_ranks=False
    ):
        """Every param's main param and state by name (``torch`` format).

        Args:
            use_gloo_comm: unused (the DP group's gloo twin is used where there is one).
            empty_data: unused (the state is always gathered).
            return_on_all_ranks: gather to every DP rank, not DP rank 0 only.

        Returns:
            ``{"format", "optimizer", "shapes", "params"}`` on the receivers, else None.
        """
        return checkpoint.get_parameter_state_dp_zero(self, return_on_all_ranks)

    def load_parameter_state_from_dp_zero(self, state_dict, *, update_legacy_format=False):
        """Scatter a ``torch``-format param state to the shards.

        Args:
            state_dict: ``get_parameter_state_dp_zero``'s output (on DP rank 0).
            update_legacy_format: unused (this format has no legacy version).
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
