"""Muon for megatron-core: the public names (upstream's, kept for its callers).

Replaces upstream's shim of the same name (megatron-core 0.19.2); upstream's behaviour unless
the config asks for this Muon (``muon_impl='megatron_muon'``). The files a step reads and the
layering, leaves first: docs/muon_in_megatron.md.
"""

import dataclasses
import warnings

from . import get_megatron_optimizer
from .megatron_muon.factory import TensorParallelMuon
from .megatron_muon.functional import LocalOrthogonalizer, MuonParamInfo, Orthogonalizer
from .megatron_muon.optimizer import Muon

__all__ = [
    "Muon",
    "MuonParamInfo",
    "LocalOrthogonalizer",
    "Orthogonalizer",
    "TensorParallelMuon",
    "get_megatron_muon_optimizer",
]


def get_megatron_muon_optimizer(
    config,
    model_chunks,
    config_overrides=None,
    use_gloo_process_groups: bool = True,
    pg_collection=None,
    dump_param_to_param_group_map=None,
    *,
    layer_wise_distributed_optimizer: bool = False,
):
    """Upstream's Muon entry point, on ``get_megatron_optimizer``, with upstream 0.19's
    parameters; ``muon_impl`` other than ``'megatron_muon'`` keeps upstream's behaviour. Else the
    config (copied, not mutated as upstream did) gets ``optimizer='muon'``.

    Args:
        config: the ``OptimizerConfig``.
        model_chunks: the DDP-wrapped model chunks.
        config_overrides: as for ``get_megatron_optimizer``.
        use_gloo_process_groups: as for ``get_megatron_optimizer``.
        layer_wise_distributed_optimizer: deprecated (``dist_muon``): DistOpt shards where DDP
            does, else unsharded; a ``DeprecationWarning`` says which.
        pg_collection: as for ``get_megatron_optimizer``.
        dump_param_to_param_group_map: as for ``get_megatron_optimizer``.

    Returns:
        A ``MegatronOptimizer`` (a ``ChainedOptimizer`` for dense and expert parts).
    """
    if config.muon_impl != "megatron_muon":
        if layer_wise_distributed_optimizer and not config.optimizer.startswith("dist_"):
            raise ValueError(  # upstream 0.19's words
                "Layer-wise distributed optimizer is enabled by dist_ prefix in optimizer name."
            )
    else:
        changes = {"optimizer": "muon"}
        if layer_wise_distributed_optimizer:
            sharded = all(c.ddp_config.use_distributed_optimizer for c in model_chunks)
            changes["use_distributed_optimizer"] = config.use_distributed_optimizer or sharded
            notice = _layer_wise_notice(changes["use_distributed_optimizer"])
            warnings.warn(notice, DeprecationWarning, stacklevel=2)
        config = dataclasses.replace(config, **changes)  # validated by get_megatron_optimizer
    return get_megatron_optimizer(
        config,
        model_chunks,
        config_overrides=config_overrides,
        use_gloo_process_groups=use_gloo_process_groups,
        pg_collection=pg_collection,
        dump_param_to_param_group_map=dump_param_to_param_group_map,
    )


def _layer_wise_notice(sharded: bool) -> str:
    how = (
        "Muon runs inside the DistributedOptimizer (use_distributed_optimizer=True)"
        if sharded
        else "the model's DDP was built without use_distributed_optimizer, so Muon's state is "
        "NOT sharded; wrap the model with DistributedDataParallelConfig("
        "use_distributed_optimizer=True) to shard it"
    )
    return (
        "get_megatron_muon_optimizer(layer_wise_distributed_optimizer=True) (optimizer "
        f"'dist_muon') is deprecated: {how}. Pass OptimizerConfig(optimizer='muon', "
        "use_distributed_optimizer=True) to get_megatron_optimizer instead."
    )
