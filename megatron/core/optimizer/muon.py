"""Muon for megatron-core: the public names (upstream's, kept for its callers).

Replaces upstream's shim of the same name (megatron-core 0.19.2): ``get_megatron_muon_optimizer``
keeps upstream's behaviour unless the config asks for this Muon (``muon_impl='megatron_muon'``).
The layering, leaves first:

* ``muon_config.py``: vocabularies and defaults (one home), config validation;
* ``newton_schulz.py``: pure Newton-Schulz;
* ``muon_functional.py``: the three stages of a Muon step (Q/K/V split, scale), AdamW;
* ``muon_optimizer.py``: ``Muon``, a plain torch optimizer (no Megatron, no DistOpt);
* ``muon_tp.py``: tensor-parallel orthogonalizers; ``muon_distopt.py``: the DistOpt exchange
  and the plan's data it runs; ``muon_plan.py``: the planner (gangs: ``muon_split.py``,
  ``muon_placement.py``, ``muon_gangs.py``);
* ``muon_distrib_optimizer.py``: ``MuonDistributedOptimizer``, which builds the plan and
  attaches the exchange;
* ``muon_megatron.py``: Megatron glue: the factory hooks, ``TensorParallelMuon``;
* here: ``get_megatron_muon_optimizer`` and the names upstream exported.

A DistOpt step at TP=1 reads five of these: ``muon_distrib_optimizer.py``,
``muon_optimizer.py`` (the optimizer), ``muon_functional.py``, ``newton_schulz.py`` (the math),
``muon_distopt.py`` (the exchange); ``muon_tp.py`` and ``muon_gangs.py`` are entered only where
TP shards a matrix or the plan splits one (docs/muon_in_megatron.md).
"""

import dataclasses
import warnings

from . import get_megatron_optimizer
from .muon_functional import LocalOrthogonalizer, MuonParamInfo, Orthogonalizer
from .muon_megatron import TensorParallelMuon
from .muon_optimizer import Muon

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
    """Upstream's Muon entry point, on ``get_megatron_optimizer``.

    Takes what upstream 0.19's shim takes: ``get_megatron_optimizer``'s parameters (in its
    order, so positional calls bind alike) and the keyword ``layer_wise_distributed_optimizer``.
    A config with ``muon_impl`` other than ``'megatron_muon'`` (the default, ``'emerging'``)
    gets upstream 0.19's behaviour: the config as given to ``get_megatron_optimizer``, and
    ``layer_wise_distributed_optimizer=True`` needs a ``dist_`` optimizer name.

    Returns the same optimizer as ``get_megatron_optimizer(config, ...)`` with
    ``config.optimizer='muon'`` (a copy of ``config`` is made if it names another optimizer;
    upstream instead mutated it to 'adam'). Unlike upstream, Muon and AdamW params share one
    optimizer per dense/expert part, and fp16 and the DistributedOptimizer are supported.

    Args:
        config: the ``OptimizerConfig``.
        model_chunks: the DDP-wrapped model chunks.
        config_overrides: per-param-group overrides, as for ``get_megatron_optimizer``.
        use_gloo_process_groups: as for ``get_megatron_optimizer``.
        layer_wise_distributed_optimizer: deprecated (upstream's ``dist_muon``). Muon's state is
            sharded by Megatron's DistributedOptimizer instead: with chunks wrapped by
            ``DistributedDataParallelConfig(use_distributed_optimizer=True)`` it is used (the
            same numbers as one process); otherwise Muon runs unsharded. Either way a
            ``DeprecationWarning`` says so.
        pg_collection: process groups, as for ``get_megatron_optimizer``.
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
