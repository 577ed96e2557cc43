"""Save and load a tiny GPT with its Megatron optimizer in each DistOpt checkpoint format.

Used inside ranks started by ``harness.run_distributed``; ``directory`` is shared by all ranks.
Files of the ``torch`` format are named by (TP, PP) rank only, so a checkpoint saved at one DP
size loads at another, as Megatron's legacy format does.
"""

import os

import torch
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps

FORMATS = ("torch", "fully_reshardable", "dp_reshardable")


def sync_params(model_chunks) -> None:
    """Finish an overlapped param all-gather, so model params are current (before save/compare)."""
    for chunk in model_chunks:
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def _torch_file(directory: str, what: str) -> str:
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    ep = ""  # expert-parallel ranks hold different experts: one file each (as Megatron)
    if ps.get_expert_model_parallel_world_size() > 1:
        ep = f"_ep{ps.get_expert_model_parallel_rank()}"
    return os.path.join(directory, f"{what}_tp{tp}_pp{pp}{ep}.pt")


def _sharded(model_chunks, optimizer, fmt: str, is_loading: bool) -> dict:
    (chunk,) = model_chunks
    model_sd = chunk.module.sharded_state_dict()  # DDP itself has no sharded_state_dict
    # as Megatron-LM's checkpointing passes it: no ChainedOptimizer prefix for fully_reshardable
    metadata = {"distrib_optim_sharding_type": fmt, "chained_optim_avoid_prefix": True}
    opt_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return {"model": model_sd, "optimizer": opt_sd}


def save(fmt: str, directory: str, model_chunks, optimizer) -> None:
    sync_params(model_chunks)
    if torch.distributed.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    if fmt == "torch":
        if ps.get_expert_data_parallel_rank() == 0:  # as Megatron: one writer per DP replica
            common = {"model": model_chunks[0].state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(common, _torch_file(directory, "common"))
        optimizer.save_parameter_state(_torch_file(directory, "param_state"))
    else:
        # one writer process per rank: tiny checkpoints, and ranks already share two cores
        strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
        sharded = _sharded(model_chunks, optimizer, fmt, False)
        dist_checkpointing.save(sharded, directory, sharded_strategy=strategy)
    torch.distributed.barrier()


def load(fmt: str, directory: str, model_chunks, optimizer, *, model=True) -> None:
    """Restore model and optimizer; ``model=False`` loads the optimizer only."""
    if fmt == "torch":
        common = torch.load(_torch_file(directory, "common"), weights_only=False)
        if model:
            model_chunks[0].load_state_dict(common["model"])
        optimizer.load_state_dict(common["optimizer"])  # before the param state (design.md 6)
        optimizer.load_parameter_state(_torch_file(directory, "param_state"))
        return
    loaded = dist_checkpointing.load(_sharded(model_chunks, optimizer, fmt, True), directory)
    if model:
        model_chunks[0].module.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
