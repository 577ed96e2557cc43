# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""An async torch_dist save must hold the values of the moment it was called. The persistent
worker (--use-persistent-ckpt-worker) receives each request through a queue, which moves a host
tensor's storage into shared memory: the worker and the trainer then hold one storage. Its
preload copies GPU tensors to the host, but left a host tensor as it was ("we believe these
tensors are detached from the model trainers"), and the trainer went on to update it in place
(the DistributedOptimizer's fp32 main params and Adam moments are whole tensors of their own, so
nothing clones them before): the files got the next step's values wherever the writer was late.
Host tensors are those of CPU training and of --optimizer-cpu-offload."""

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from tests.unit_tests.test_utilities import Utils

from megatron.core import dist_checkpointing
from tests.unit_tests.dist_checkpointing import TempNamedDir


def _sharded(tensor: torch.Tensor) -> dict:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return {"w": ShardedTensor.from_rank_offsets("w", tensor, (0, rank, world))}


def test_preload_copies_a_host_tensor_the_trainer_shares():
    trainer = torch.arange(6.0).share_memory_()  # as the worker receives it from the queue
    buckets = [("f.distcp", "key", ([], [("item", trainer)]))]
    out = FileSystemWriterAsync.preload_tensors(buckets, non_blocking=False)[0][2][1][0][1]
    assert torch.equal(out, torch.arange(6.0))
    assert out.untyped_storage().data_ptr() != trainer.untyped_storage().data_ptr()
    private = torch.arange(6.0)  # a synchronous save's: written before the trainer goes on
    buckets = [("f.distcp", "key", ([], [("item", private)]))]
    out = FileSystemWriterAsync.preload_tensors(buckets, non_blocking=False)[0][2][1][0][1]
    assert out.untyped_storage().data_ptr() == private.untyped_storage().data_ptr()


def test_persistent_async_save_holds_the_values_at_the_save_call(tmp_path_dist_ckpt):
    Utils.initialize_model_parallel(1, 1)
    # on the host, whether or not the job trains on GPUs (--optimizer-cpu-offload keeps its
    # state there): a whole tensor of its own, which the save planning does not clone
    state = torch.full((1 << 16,), float(torch.distributed.get_rank()))
    expected = state.clone()
    queue = AsyncCallsQueue(persistent=True)
    try:
        with TempNamedDir(tmp_path_dist_ckpt / "async_host_tensors", sync=True) as ckpt_dir:
            request = dist_checkpointing.save(
                _sharded(state), ckpt_dir, async_sharded_save=True, async_strategy="mcore"
            )
            queue.schedule_async_request(request)
            state.add_(1.0)  # the next optimizer step, in place, while the worker writes
            queue.maybe_finalize_async_calls(blocking=True)
            loaded = dist_checkpointing.load(_sharded(torch.empty_like(state)), ckpt_dir)["w"]
            assert torch.equal(loaded, expected)  # before the fix: expected + 1 (the next step)
    finally:
        queue.close()
        Utils.destroy_model_parallel()
