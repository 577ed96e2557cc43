"""GPT train/valid/test data as Megatron-LM's pretrain_gpt.py builds it, on megatron-core 0.16.1:
BlendedMegatronDatasetBuilder + GPTDatasetConfig + GPTDataset (or MockGPTDataset), a
consumed-samples sampler so that a resumed run continues on exactly the next sample, and
``get_batch`` returning (tokens, labels, loss_mask, attention_mask, position_ids).

Plain functions with keyword names matching Megatron-LM's arguments (data_path, split,
seq_length, mock_data, seed, micro_batch_size, ...). Works with and without an initialized
torch.distributed process group and megatron-core's parallel_state:
- no process group: everything is built in this process;
- a process group: rank 0 builds the index caches first, the others wait (the builder's barrier),
  and only TP rank 0 of the first and last pipeline stages builds datasets, as in pretrain_gpt.py;
  ``get_batch`` broadcasts the batch from TP rank 0 to the rest of its TP group.
"""

import contextlib
import math

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split
from megatron.core.parallel_state import (
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
    get_tensor_model_parallel_world_size,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    model_parallel_is_initialized,
)

Blend = tuple[list[str], list[float] | None]


def parse_data_path(data_path: str | list[str] | None, flag: str = "--data-path") -> Blend | None:
    """Megatron-LM's ``--data-path``: ``prefix``, ``prefixA prefixB`` (weights from sizes), or
    ``wA prefixA wB prefixB`` (weights, normalized later). Returns (prefixes, weights or None)."""
    if data_path is None:
        return None
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        return None
    weights = [_as_float(x) for x in items[0::2]]
    if len(items) % 2 == 1 or all(w is None for w in weights):
        if len(items) > 1 and weights[0] is not None:
            raise ValueError(f"{flag} {items}: weights and prefixes must alternate: w1 p1 w2 p2")
        return items, None
    if any(w is None for w in weights):
        raise ValueError(f"{flag} {items}: weights and prefixes must alternate: w1 p1 w2 p2")
    if any(not (0 < w < math.inf) for w in weights):  # NaN fails both comparisons
        raise ValueError(f"{flag} {items}: every weight must be finite and > 0, got {weights}")
    return items[1::2], weights


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def check_prefixes_exist(blend: Blend | None, flag: str = "--data-path") -> None:
    """Fail early, naming the flag, instead of deep inside the dataset build."""
    for prefix in blend[0] if blend else []:
        if not IndexedDataset.exists(prefix):
            raise ValueError(
                f"{flag} prefix {prefix!r}: no {prefix}.bin / {prefix}.idx "
                "(write them with tools/preprocess_data.py)"
            )


def train_valid_test_num_samples(
    train_iters: int,
    global_batch_size: int,
    eval_interval: int,
    eval_iters: int,
    train_samples: int | None = None,
    full_validation: bool = False,
) -> list[int | None]:
    """Samples each split must provide, as Megatron-LM's training.py counts them: every
    evaluation (one per eval_interval, plus the final one) reads eval_iters batches. With
    ``full_validation`` the validation split asks for None: megatron-core then builds exactly one
    epoch of it."""
    train = train_samples if train_samples else train_iters * global_batch_size
    evaluations = train_iters // eval_interval + 1 if eval_interval else 1
    valid = None if full_validation else evaluations * eval_iters * global_batch_size
    return [train, valid, eval_iters * global_batch_size]


def gpt_dataset_config(
    tokenizer,
    seq_length: int,
    seed: int = 1234,
    data_path=None,
    split: str | None = "969,30,1",
    mock_data: bool = False,
    train_data_path=None,
    valid_data_path=None,
    test_data_path=None,
    data_cache_path: str | None = None,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    create_attention_mask_in_dataloader: bool = False,
    mmap_bin_files: bool = True,
    num_dataset_builder_threads: int = 1,
    mid_level_dataset_surplus: float = 0.005,
    allow_ambiguous_pad_tokens: bool = False,
    sequences_per_dataset: dict | None = None,
) -> GPTDatasetConfig:
    """pretrain_gpt.py's ``core_gpt_dataset_config_from_args``. With mock_data no blend is passed,
    so megatron-core sets ``config.mock`` and the builder makes MockGPTDatasets; no data path
    without mock_data is a ValueError. Per-split paths override data_path.
    Unlike Megatron-LM, create_attention_mask_in_dataloader defaults to False: our models use
    causal masks, and a [s, s] mask per sample costs memory and broadcast time for nothing."""
    blend, blend_per_split = _blends(
        data_path, train_data_path, valid_data_path, test_data_path, mock_data
    )
    return GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split if blend is not None else None,
        path_to_cache=data_cache_path,
        mmap_bin_files=mmap_bin_files,
        num_dataset_builder_threads=num_dataset_builder_threads,
        mid_level_dataset_surplus=mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=allow_ambiguous_pad_tokens,
        sequences_per_dataset=sequences_per_dataset,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask_in_dataloader,
    )


_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def _blends(data_path, train_data_path, valid_data_path, test_data_path, mock_data):
    if mock_data:
        return None, None
    paths = (train_data_path, valid_data_path, test_data_path)
    per_split = [parse_data_path(p, flag) for p, flag in zip(paths, _SPLIT_FLAGS)]
    if any(per_split):
        for blend, flag in zip(per_split, _SPLIT_FLAGS):
            check_prefixes_exist(blend, flag)
        return None, per_split
    blend = parse_data_path(data_path)
    if blend is None:
        raise ValueError("no data: pass --data-path (or per-split paths) or --mock-data")
    check_prefixes_exist(blend)
    return blend, None


def is_dataset_built_on_rank() -> bool:
    """pretrain_gpt.py's rule: TP rank 0 of the first and last pipeline stages reads data (the
    others get it by broadcast or need none). Every rank when parallel_state is not set up."""
    if not model_parallel_is_initialized():
        return True
    first_or_last = is_pipeline_first_stage() or is_pipeline_last_stage()
    return first_or_last and get_tensor_model_parallel_rank() == 0


def build_train_valid_test_datasets(config: GPTDatasetConfig, train_valid_test_num_samples):
    """(train, valid, test), each a GPTDataset/BlendedDataset, or None for an empty split or on a
    rank that builds no data. Call on every rank: the build has barriers."""
    check_splits_have_documents(config, train_valid_test_num_samples)
    cls = MockGPTDataset if config.mock else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        cls, list(train_valid_test_num_samples), is_dataset_built_on_rank, config
    )
    with _rank_zero_without_process_group():
        return tuple(builder.build())


@contextlib.contextmanager
def _rank_zero_without_process_group():
    """megatron-core 0.16.1's BlendedDataset._build_indices calls torch.distributed.get_rank()
    unguarded when a cache path is set and the cache misses, so a blend with data_cache_path
    fails in a single process without a process group. There this process is rank 0: say so
    for the duration of the build. (A one-line upstream patch would make this unnecessary.)"""
    if torch.distributed.is_initialized():
        yield
        return
    get_rank = torch.distributed.get_rank
    torch.distributed.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        torch.distributed.get_rank = get_rank


def check_splits_have_documents(config: GPTDatasetConfig, num_samples) -> None:
    """megatron-core 0.16.1 loops forever (GPTDataset._get_num_epochs) when a split that must
    provide samples gets no document, e.g. '969,30,1' over fewer than ~500 documents leaves the
    test split empty. Raise instead, naming the split and the counts."""
    if config.mock:
        return
    for split in Split:
        blend = config.blend if config.blend else config.blend_per_split[split.value]
        bounds = config.split_matrix[split.value] if config.blend else (0.0, 1.0)
        needed = num_samples[split.value]  # None: one epoch (--full-validation)
        if needed == 0 or blend is None or bounds is None:
            continue  # megatron-core builds no dataset for this split
        for prefix in blend[0]:
            docs = IndexedDataset(prefix).sequence_lengths.shape[0]
            if int(round(bounds[0] * docs)) == int(round(bounds[1] * docs)):
                raise ValueError(
                    f"--split {config.split!r} leaves the {split.name} split of {prefix!r} "
                    f"({docs} documents) empty, but "
                    f"{'one epoch of' if needed is None else needed} {split.name} "
                    "samples are needed: give that split a larger share (e.g. '98,1,1'), "
                    "more data, or no samples (--eval-iters 0)"
                )


class MegatronPretrainingSampler:
    """Megatron-LM's sequential batch sampler: each global batch takes the next
    ``micro_batch_size * data_parallel_size`` sample indices from ``consumed_samples`` on, and
    this rank yields its contiguous ``micro_batch_size`` slice. Resuming with the consumed count
    of a checkpoint therefore continues on exactly the next sample."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        _check_sampler_args(
            total_samples,
            consumed_samples,
            micro_batch_size,
            data_parallel_rank,
            data_parallel_size,
        )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_micro_batch = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def _slice(self, batch: list[int]) -> list[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start : start + self.micro_batch_size]

    def __iter__(self):
        batch = []
        for idx in range(self.consumed_samples, self.total_samples):
            batch.append(idx)
            if len(batch) == self.global_micro_batch:
                yield self._slice(batch)
                batch = []
        if batch and not self.drop_last:
            yield self._slice(batch)


def _check_sampler_args(total, consumed, micro_batch_size, dp_rank, dp_size) -> None:
    if total <= 0:
        raise ValueError(f"total_samples must be > 0, got {total} (is the split empty?)")
    if not 0 <= consumed < total:
        raise ValueError(f"consumed_samples must be in [0, {total}), got {consumed}")
    check_batch_layout(micro_batch_size, dp_rank, dp_size)


def check_batch_layout(micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
    """The micro-batch size and data-parallel coordinates every sampler needs."""
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be > 0, got {micro_batch_size}")
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(
            f"need 0 <= data_parallel_rank ({dp_rank}) < data_parallel_size ({dp_size})"
        )


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int | None = None,
    data_parallel_size: int | None = None,
    num_workers: int = 0,
    dataloader_type: str = "single",
    data_sharding: bool = True,
):
    """A DataLoader over ``dataset`` from ``consumed_samples`` on (None for a None dataset). The
    DP rank and size default to parallel_state's, or 0 and 1 when it is not set up.
    ``dataloader_type`` single: the sequential sampler (``consumed_samples`` < len); cyclic:
    Megatron-LM's random sampler (random_sampler.py; any ``consumed_samples``)."""
    if dataset is None:
        return None
    if data_parallel_size is None:
        data_parallel_rank, data_parallel_size = _data_parallel_rank_and_size()
    ranks = (micro_batch_size, data_parallel_rank, data_parallel_size)
    if dataloader_type == "cyclic":
        from .random_sampler import MegatronPretrainingRandomSampler

        sampler = MegatronPretrainingRandomSampler(
            len(dataset), consumed_samples, *ranks, data_sharding=data_sharding
        )
    elif dataloader_type == "single":
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, *ranks)
    else:
        raise ValueError(f"dataloader_type must be single or cyclic, got {dataloader_type!r}")
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )


def _data_parallel_rank_and_size() -> tuple[int, int]:
    if not model_parallel_is_initialized():
        return 0, 1
    return get_data_parallel_rank(), get_data_parallel_world_size()


def cyclic_iter(iterable):
    """Restart the loader at its end (Megatron-LM's ``cyclic`` data loader type, for eval)."""
    while True:
        yield from iterable


_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, micro_batch_size: int, seq_length: int, device=None):
    """pretrain_gpt.py's ``get_batch``: (tokens, labels, loss_mask, attention_mask,
    position_ids), attention_mask None unless the dataset creates one (models use causal masks).
    Middle pipeline stages get all None; other TP ranks receive TP rank 0's batch."""
    if model_parallel_is_initialized():
        if not (is_pipeline_first_stage() or is_pipeline_last_stage()):
            return (None,) * len(_BATCH_KEYS)
        if get_tensor_model_parallel_world_size() > 1:
            return _broadcast_batch(data_iterator, micro_batch_size, seq_length, device)
    batch = next(data_iterator)
    return tuple(_to(batch.get(k), device) for k in _BATCH_KEYS)


def _to(tensor, device):
    return tensor if tensor is None or device is None else tensor.to(device, non_blocking=True)


def _broadcast_batch(data_iterator, micro_batch_size, seq_length, device):
    """TP rank 0 reads and sends; a flag says whether an attention mask follows, so the
    receivers need not know the dataset config."""
    src = get_tensor_model_parallel_src_rank()
    group = get_tensor_model_parallel_group()
    device = device or "cpu"
    shapes = {"attention_mask": (micro_batch_size, 1, seq_length, seq_length)}
    dtypes = {"loss_mask": torch.float32, "attention_mask": torch.bool}
    batch = next(data_iterator) if get_tensor_model_parallel_rank() == 0 else {}
    has_mask = torch.tensor([int(batch.get("attention_mask") is not None)], device=device)
    torch.distributed.broadcast(has_mask, src, group=group)
    out = []
    for key in _BATCH_KEYS:
        if key == "attention_mask" and not has_mask.item():
            out.append(None)
            continue
        if batch:
            t = batch[key].to(device)
        else:
            shape = shapes.get(key, (micro_batch_size, seq_length))
            t = torch.empty(shape, dtype=dtypes.get(key, torch.int64), device=device)
        torch.distributed.broadcast(t, src, group=group)
        out.append(t)
    return tuple(out)
