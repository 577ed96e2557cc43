"""``--dataloader-type cyclic``: Megatron-LM's ``MegatronPretrainingRandomSampler``.

Epoch e (= consumed_samples // A, with A the samples of whole global batches in the dataset)
reads a permutation drawn from ``torch.Generator().manual_seed(e)``; a loader restarted at its
end (the cyclic iterator) starts the next epoch with a new permutation. Everything follows from
``consumed_samples``, so a resumed run continues with exactly the next batch.

- data sharding (Megatron-LM's default): rank r owns the contiguous shard
  [r*B, (r+1)*B), B = (total // (micro*dp)) * micro samples, and walks its own permutation of it;
- without (``--no-data-sharding``): one permutation of the epoch, dealt round-robin over the
  data-parallel ranks, so that each global batch is a contiguous run of it.

Deliberate difference: without sharding, Megatron-LM permutes ``(total // micro) * micro``
samples but counts an epoch as whole global batches, so when the two differ the ranks see
different numbers of batches at the end of an epoch (and drift apart); here the epoch stops at
its last whole global batch on every rank. With sharding the two agree.
"""

import torch

from .datasets import check_batch_layout


class MegatronPretrainingRandomSampler:
    """Yields this rank's micro-batches of sample indices from ``consumed_samples`` on."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool = True,
    ):
        global_batch = micro_batch_size * data_parallel_size
        if total_samples < global_batch:
            raise ValueError(
                f"--dataloader-type cyclic needs at least one global micro-batch of samples "
                f"({global_batch}), the dataset has {total_samples}"
            )
        if consumed_samples < 0:  # past the dataset is fine: the next epochs
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        check_batch_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.global_micro_batch = global_batch
        self.data_sharding = data_sharding
        self.epoch_samples = total_samples - total_samples % global_batch

    def __len__(self) -> int:
        return self.total_samples

    def _epoch_indices(self, epoch: int, offset: int) -> list:
        """This rank's indices of ``epoch`` from the epoch's ``offset``-th sample on."""
        generator = torch.Generator().manual_seed(epoch)
        if self.data_sharding:
            shard = (self.total_samples // self.global_micro_batch) * self.micro_batch_size
            start = self.data_parallel_rank * shard
            order = torch.randperm(shard, generator=generator).tolist()
            return [start + i for i in order[offset // self.data_parallel_size :]]
        bucket = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
        order = torch.randperm(bucket, generator=generator).tolist()
        active = order[offset : self.epoch_samples]
        return active[self.data_parallel_rank :: self.data_parallel_size]

    def __iter__(self):
        epoch, offset = divmod(self.consumed_samples, self.epoch_samples)
        assert offset % self.global_micro_batch == 0, "consumed samples are whole global batches"
        batch = []
        for index in self._epoch_indices(epoch, offset):
            batch.append(index)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.global_micro_batch
                yield batch
                batch = []
