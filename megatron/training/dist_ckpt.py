"""torch_dist checkpoint options, as Megatron-LM applies them, on megatron.core.dist_checkpointing.

- ``--ckpt-fully-parallel-save`` (on by default; ``--no-ckpt-fully-parallel-save`` turns it off)
  and ``--ckpt-fully-parallel-load``: core's ``FullyParallel{Save,Load}StrategyWrapper`` spread
  the writes / reads of replicated shards over the data-parallel group (each written or read
  once, then exchanged). The files are the same either way.
- ``--ckpt-assume-constant-structure``: the save strategy is kept for the whole run and caches
  the checkpoint's structure (torch's save plan, the fully parallel shard distribution); saves
  after the first skip the sharding validation. The model and optimizer must keep their
  structure for the run (they do in this stack: nothing is added or removed after setup).
- ``--dist-ckpt-optim-fully-reshardable``: DistributedOptimizer state in the
  ``fully_reshardable`` layout (model-space tensors: TP/PP/DP reshardable) instead of
  ``dp_reshardable`` (Megatron-LM 0.16's default). The layout is recorded as the checkpoint's
  content metadata and a load follows the checkpoint, whatever this run's flag says.
- ``--dist-ckpt-strictness``: core's ``StrictHandling`` for keys that differ between the
  checkpoint and what this run loads (e.g. ``rng_state`` with ``--no-load-rng``); the
  ``return_*`` values print what they return.
- ``--async-save``: the tensors are written by a background process (core's
  ``AsyncCallsQueue``); the checkpoint keeps its ``.partial`` name and the latest-iteration
  tracker keeps pointing at the previous checkpoint until every rank's write has finished (the
  queue checks that collectively). Pending saves are finalized between steps, and before the
  run ends.
"""

from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
    load_content_metadata,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag

from megatron.core import parallel_state

from .log import print_rank_0

SHARDING_KEY = "distrib_optim_sharding_type"
# Checkpoints written before the layout was recorded hold dp_reshardable state.
DEFAULT_SHARDING = "dp_reshardable"

# Kept for the run: the cached save strategy (--ckpt-assume-constant-structure), async saves.
_RUN = {"save_strategy": None, "async_queue": None}


def sharding_metadata(args) -> dict:
    """The DistOpt layout a save writes (and records as the checkpoint's content metadata)."""
    fully = args.dist_ckpt_optim_fully_reshardable
    return {SHARDING_KEY: "fully_reshardable" if fully else DEFAULT_SHARDING}


def loaded_sharding_metadata(common: dict) -> dict:
    """The DistOpt layout of a checkpoint, from its common state (the one it was saved with)."""
    saved = load_content_metadata(preloaded_state_dict=common) or {}
    return {SHARDING_KEY: saved.get(SHARDING_KEY, DEFAULT_SHARDING)}


def _dp_group():
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def save_strategy(args):
    """(strategy, validate_access_integrity) for the next torch_dist save."""
    cached = _RUN["save_strategy"]
    if cached is not None:  # only kept with --ckpt-assume-constant-structure
        return cached, False
    strategy = get_default_save_sharded_strategy("torch_dist")
    constant = args.ckpt_assume_constant_structure
    if constant:
        strategy.use_cached_ckpt_structure = True
    if args.ckpt_fully_parallel_save:
        strategy = FullyParallelSaveStrategyWrapper(strategy, _dp_group(), constant)
    if constant:
        _RUN["save_strategy"] = strategy
    return strategy, True


def load_strategy(args, folder: str):
    """The strategy a torch_dist load reads ``folder`` with."""
    strategy = get_default_load_sharded_strategy(folder)
    if args.ckpt_fully_parallel_load:
        strategy = FullyParallelLoadStrategyWrapper(strategy, _dp_group())
    return strategy


def strictness(args) -> StrictHandling:
    """--dist-ckpt-strictness as core's StrictHandling (the parser allows only its values)."""
    return parse_strict_flag(args.dist_ckpt_strictness)


def loaded_state(result, strict: StrictHandling):
    """The state dict of ``dist_checkpointing.load``; the ``return_*`` values also return the
    mismatching keys, which are printed here (the loop has no other use for them)."""
    if not StrictHandling.requires_returning_mismatch_keys(strict):
        return result
    state, missing, unexpected = result
    print_rank_0(
        f" > --dist-ckpt-strictness {strict.value}: in the checkpoint but not loaded: "
        f"{sorted(missing)}; requested but not in the checkpoint: {sorted(unexpected)}"
    )
    return state


def schedule_async(request, finalize) -> None:
    """Queue an async save; ``finalize()`` runs on every rank once all ranks' writes are done."""
    if _RUN["async_queue"] is None:
        _RUN["async_queue"] = AsyncCallsQueue()
    request.add_finalize_fn(finalize)
    _RUN["async_queue"].schedule_async_request(request)


def finalize_async_saves(blocking: bool) -> None:
    """Finalize the async saves whose writes finished (all of them, waiting, if ``blocking``).
    Collective when saves are pending: every rank calls it at the same points of the loop."""
    queue = _RUN["async_queue"]
    if queue is not None:
        queue.maybe_finalize_async_calls(blocking=blocking)
        if blocking:
            queue.close()
            _RUN["async_queue"] = None
