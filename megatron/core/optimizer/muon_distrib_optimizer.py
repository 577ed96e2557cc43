"""Megatron's DistributedOptimizer (ZeRO-1) with our Muon as its inner optimizer.

The factory (patch 0002) builds this class instead of ``DistributedOptimizer`` when the config
asks for our Muon (``optimizer='muon'``, ``muon_impl='megatron_muon'``). Upstream's class shards
the params and steps the inner optimizer; this one adds what Muon needs on top:

* the exchange: after upstream's ``__init__`` replaced the inner optimizer's params by 1-D shard
  main params, ``muon_distopt.attach`` plans one owner per matrix and routes whole matrices
  there (docs/muon_in_megatron.md, "DistributedOptimizer");
* the layout: ``compute_full_param_layout`` gives DDP's buffers upstream's LayerWise layout
  (every Muon matrix whole in one DP shard) where that balances the Newton-Schulz work, so each
  holder owns its matrices and the exchange moves nothing; else DistOpt's (``muon_layout.py``);
* checkpoints: the inner optimizer declares its state (``state_keys``), so every DistOpt format
  (``torch``, ``torch_dist`` fully/dp-reshardable) saves and loads it by name
  (``muon_checkpoint.py``, ``muon_checkpoint_sharded.py``).
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
    """``DistributedOptimizer`` whose inner optimizer is ``MegatronMuon``: exact Muon on DP
    shards, checkpoints of its declared state in every DistOpt format.

    Args: those of ``DistributedOptimizer``; ``optimizer`` is a ``MegatronMuon``.
    """

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
        """Start the param all-gather of every bucket group: the shard-aligned Muon buffers
        are this optimizer's too (upstream's skips them, leaving them to a LayerWise sibling)."""
        for chunk in self.model_chunks:
            for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                if group.buckets:
                    chunk._start_bucket_group_param_sync(group, force_sync=False)

    def state_dict(self):
        """The common state: param groups, grad scaler and the format marker.

        Returns:
            The state dict ``load_state_dict`` takes (param state apart, per format).
        """
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict):
        """Load a state dict of any DistOpt format this class saves; one of another optimizer
        is refused, naming it.

        Args:
            state_dict: the common state dict, with the param state of its format.
        """
        sharded.load_state_dict(self, state_dict)

    def get_parameter_state_dp_zero(
        self, use_gloo_comm: bool = True, empty_data: bool = False, return_on_all_ranks=False
    ):
        """Every param's main param and state, gathered by name (``torch`` format).

        Args:
            use_gloo_comm: upstream's argument; the gather uses the DP group's own backend.
            empty_data: upstream's argument; unused (the state is always gathered).
            return_on_all_ranks: gather to every DP rank, not DP rank 0 only.

        Returns:
            ``{"format", "optimizer", "shapes", "params"}`` on the receiving ranks, else None.
        """
        return checkpoint.get_parameter_state_dp_zero(self, return_on_all_ranks)

    def load_parameter_state_from_dp_zero(self, state_dict, *, update_legacy_format=False):
        """Scatter a ``torch``-format param state to the shards.

        Args:
            state_dict: ``get_parameter_state_dp_zero``'s output (on DP rank 0).
            update_legacy_format: upstream's argument; no legacy format of this one exists.
        """
        checkpoint.scatter_state(self, state_dict)

    def sharded_param_state_fully_reshardable(
        self, model_sharded_state_dict, is_loading: bool = False, metadata=None
    ):
        """``torch_dist`` fully reshardable param state: model-space tensors by name.

        Args:
            model_sharded_state_dict: the model's sharded state dict (names, TP/PP placement).
            is_loading: build the placeholders a load fills.
            metadata: upstream's checkpoint metadata; unused.

        Returns:
            The sharded param state.
        """
        return sharded.sharded_fully_reshardable(self, model_sharded_state_dict, is_loading)

    def sharded_param_state_dp_reshardable(
        self, model_sharded_state_dict, is_loading: bool = False, metadata=None
    ):
        """``torch_dist`` DP-reshardable param state: buffer-space tensors.

        Args:
            model_sharded_state_dict: the model's sharded state dict.
            is_loading: build the placeholders a load fills.
            metadata: upstream's checkpoint metadata; unused.

        Returns:
            The sharded param state.
        """
        return sharded.sharded_dp_reshardable(self, model_sharded_state_dict, is_loading)

    def sharded_param_state_fs_model_space(
        self, model_sharded_state_dict, is_loading: bool = False, metadata=None
    ):
        """Refused (NotImplementedError): no ``fully_sharded_model_space`` format of a declared
        state.

        Args:
            model_sharded_state_dict: the model's sharded state dict.
            is_loading: whether for a load.
            metadata: upstream's checkpoint metadata.
        """
        checkpoint.unsupported_format(self, "fully_sharded_model_space")
