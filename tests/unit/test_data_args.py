"""--dataloader-type cyclic (Megatron-LM's random sampler: epochs, sharding, exact resume),
--per-split-data-args-path (Megatron-LM's JSON), and the tokenizer/data flag checks.

    .venv/bin/python -m pytest -q tests/unit/test_data_args.py
"""

import json

import numpy
import pytest
import torch

from megatron.training.arguments import ArgumentsError, parse_args
from megatron.training.random_sampler import MegatronPretrainingRandomSampler

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --train-iters 1 --lr 1e-3"
).split()


def _stream(total, consumed, batches, rank, dp=2, micro=2, sharding=True) -> list:
    """``batches`` micro-batches of one rank, restarting the sampler at its end as the cyclic
    iterator does (each restart is the next epoch)."""
    sampler = MegatronPretrainingRandomSampler(total, consumed, micro, rank, dp, sharding)
    out = []
    while len(out) < batches:
        out.extend(sampler)
    return out[:batches]


@pytest.mark.parametrize("sharding", [True, False])
@pytest.mark.parametrize("total", [23, 24])
def test_resume_at_any_step_continues_the_same_stream(sharding, total):
    """Three epochs uninterrupted, then a fresh sampler at each step's consumed count: it must
    yield exactly the rest (the count is all a checkpoint keeps)."""
    per_epoch = total // 4  # global micro-batches of 2 x 2 per epoch
    for rank in (0, 1):
        full = _stream(total, 0, 3 * per_epoch, rank, sharding=sharding)
        for step in range(1, 3 * per_epoch):
            rest = _stream(total, 4 * step, 3 * per_epoch - step, rank, sharding=sharding)
            assert rest == full[step:], (rank, step)


@pytest.mark.parametrize("sharding", [True, False])
def test_each_epoch_reads_its_samples_once_and_reshuffles(sharding):
    total, per_epoch = 23, 5  # 20 samples of whole global batches per epoch; 3 left out
    epochs = []
    for epoch in range(2):
        seen = [i for rank in (0, 1) for b in _stream(total, 20 * epoch, per_epoch, rank,
                sharding=sharding) for i in b]  # fmt: skip
        assert len(seen) == len(set(seen)) == 20 and max(seen) < total
        epochs.append(seen)
    assert epochs[0] != epochs[1]
    if sharding:  # each rank's shard, reshuffled: the same 20 samples
        assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(20))
    else:  # 20 of the 22 = (23 // 2) * 2 permuted samples, a new draw each epoch (Megatron-LM)
        assert max(epochs[0] + epochs[1]) < 22


def test_sharded_order_is_megatron_lms():
    """Data sharding (Megatron-LM's default): rank r walks torch.randperm(B, seed=epoch) of its
    own shard [r*B, (r+1)*B), B = (total // (micro*dp)) * micro."""
    total, shard = 23, 10
    for epoch in range(2):
        for rank in (0, 1):
            order = torch.randperm(shard, generator=torch.Generator().manual_seed(epoch))
            expected = [rank * shard + i for i in order.tolist()]
            got = [i for b in _stream(total, 20 * epoch, 5, rank) for i in b]
            assert got == expected


def test_unsharded_epoch_ends_at_the_same_batch_on_every_rank():
    """Megatron-LM permutes (total // micro) * micro samples and deals them over the ranks; with
    micro 1, dp 2 and 5 samples its rank 0 reads 3 batches, rank 1 two, and they drift apart.
    Here an epoch stops at its last whole global batch on every rank (module docstring)."""
    for total in range(2, 12):
        counts = [len(list(MegatronPretrainingRandomSampler(total, 0, 1, r, 2, False)))
                  for r in (0, 1)]  # fmt: skip
        assert counts == [total // 2] * 2, total


def test_sampler_bad_input():
    with pytest.raises(ValueError, match="at least one global micro-batch of samples \\(4\\)"):
        MegatronPretrainingRandomSampler(3, 0, 2, 0, 2)
    with pytest.raises(ValueError, match="data_parallel_rank \\(2\\) < data_parallel_size"):
        MegatronPretrainingRandomSampler(8, 0, 2, 2, 2)


def test_loader_types(tmp_path):
    from megatron.training import datasets

    data = list(range(12))
    single = datasets.build_pretraining_data_loader(data, 4, 2, 0, 1)
    cyclic = datasets.build_pretraining_data_loader(data, 4, 2, 0, 1, dataloader_type="cyclic")
    assert [b.tolist() for b in single] == [[4, 5], [6, 7], [8, 9], [10, 11]]
    assert isinstance(cyclic.batch_sampler, MegatronPretrainingRandomSampler)
    assert sorted(i for b in cyclic for i in b.tolist()) != list(range(4, 12))  # shuffled
    with pytest.raises(ValueError, match="single or cyclic, got 'external'"):
        datasets.build_pretraining_data_loader(data, 0, 2, 0, 1, dataloader_type="external")


def _per_split_file(tmp_path, table) -> str:
    path = tmp_path / "splits.json"
    path.write_text(table if isinstance(table, str) else json.dumps(table))
    return str(path)


def test_per_split_data_args_path_fills_the_split_paths(tmp_path):
    table = {"train": "0.7 a 0.3 b", "valid": ["v"], "test": None}
    args = parse_args(
        BASE + ["--per-split-data-args-path", _per_split_file(tmp_path, table)], world_size=1
    )
    assert args.train_data_path == ["0.7", "a", "0.3", "b"]
    assert (args.valid_data_path, args.test_data_path) == (["v"], None)


PER_SPLIT_ERRORS = [
    ({"train": "a", "valid": "b"}, [], "keys must be exactly ['train', 'valid', 'test'] "
     "(missing ['test'], unknown [])"),
    ({"train": "a", "valid": "b", "test": None, "dev": "c"}, [], "unknown ['dev']"),
    ({"train": 5, "valid": None, "test": None}, [], "'train' must be a string, a list"),
    ("{oops", [], "not valid JSON"),
    ("[1]", [], "expected a JSON object"),
    ({"train": "a", "valid": None, "test": None}, ["--train-data-path", "x"],
     "--per-split-data-args-path and --train-data-path are exclusive"),
    ({"train": "a", "valid": None, "test": None}, ["--data-path", "x"],
     "--per-split-data-args-path and --data-path are exclusive"),
    ({"train": "a", "valid": None, "test": None}, ["--mock-data"], "exclusive"),
    ({"train": None, "valid": None, "test": None}, [], "no data"),
]  # fmt: skip


@pytest.mark.parametrize("table, extra, message", PER_SPLIT_ERRORS)
def test_per_split_data_args_path_errors(tmp_path, table, extra, message):
    flags = ["--per-split-data-args-path", _per_split_file(tmp_path, table), *extra]
    with pytest.raises(ArgumentsError) as err:
        parse_args(BASE + flags, world_size=1)
    assert message in str(err.value)


def test_per_split_data_args_path_missing_file():
    with pytest.raises(ArgumentsError, match="'/no/s.json': cannot read it"):
        parse_args(BASE + ["--mock-data", "--per-split-data-args-path", "/no/s.json"], world_size=1)


FLAG_ERRORS = [
    ("--mock-data --tiktoken-pattern v2 --tiktoken-num-special-tokens 9",
     "--tiktoken-pattern, --tiktoken-num-special-tokens configure TikTokenizer"),
    ("--mock-data --tokenizer-type TikTokenizer --tokenizer-model r.json",
     "TikTokenizer needs --tiktoken-pattern v1 or v2, got None"),
    ("--mock-data --tokenizer-type TikTokenizer --tokenizer-model r.json --tiktoken-pattern v9",
     "got v9"),
    ("--mock-data --tokenizer-type Llama2Tokenizer", "Llama2Tokenizer needs --tokenizer-model "
     "(a sentencepiece .model file)"),
    ("--mock-data --tokenizer-type GPTSentencePieceTokenizer", "needs --tokenizer-model"),
    ("--mock-data --no-data-sharding", "--no-data-sharding changes the shuffled order of "
     "--dataloader-type cyclic only"),
    ("--mock-data --dataloader-type external", "--dataloader-type external is not supported"),
    ("--mock-data --vocab-extra-ids 4", "--vocab-extra-ids adds <extra_id_k> tokens to "
     "SentencePieceTokenizer only"),
]  # fmt: skip


@pytest.mark.parametrize("extra, message", FLAG_ERRORS)
def test_tokenizer_and_loader_flag_errors(extra, message):
    with pytest.raises(ArgumentsError) as err:
        parse_args(BASE + extra.split(), world_size=1)
    assert message in str(err.value)


def test_accepted_combinations():
    args = parse_args(BASE + "--mock-data --dataloader-type cyclic --no-data-sharding".split(), 1)
    assert (args.dataloader_type, args.data_sharding) == ("cyclic", False)
    assert parse_args(BASE + ["--mock-data"], world_size=1).dataloader_type == "single"
    tt = "--mock-data --tokenizer-type TikTokenizer --tokenizer-model r.json --tiktoken-pattern v1"
    args = parse_args(BASE + tt.split() + ["--tiktoken-special-tokens", "<unk>", "<s>", "</s>"], 1)
    assert args.tiktoken_special_tokens == ["<unk>", "<s>", "</s>"]


def test_data_args_path_reads_the_data_path_items(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("0.3 a\n0.7  b\n")
    args = parse_args(BASE + ["--data-args-path", str(path)], world_size=1)
    assert args.data_path == ["0.3", "a", "0.7", "b"]
    for extra, message in (
        (["--data-path", "x"], "--data-args-path and --data-path are exclusive"),
        (["--train-data-path", "x"], "--train-data-path/--valid-data-path/--test-data-path are"),
    ):
        with pytest.raises(ArgumentsError, match=message):
            parse_args(BASE + ["--data-args-path", str(path), *extra], world_size=1)
    path.write_text("  \n")
    with pytest.raises(ArgumentsError, match="is empty"):
        parse_args(BASE + ["--data-args-path", str(path)], world_size=1)
    with pytest.raises(ArgumentsError, match="'/no/d.txt': cannot read it"):
        parse_args(BASE + ["--data-args-path", "/no/d.txt"], world_size=1)


def test_reset_attention_mask_turns_the_loader_mask_on_or_is_refused():
    args = parse_args(BASE + ["--mock-data", "--reset-attention-mask"], world_size=1)
    assert args.create_attention_mask_in_dataloader
    assert any("--reset-attention-mask" in n for n in args.notices)
    assert not parse_args(BASE + ["--mock-data"], world_size=1).create_attention_mask_in_dataloader
    with pytest.raises(ArgumentsError, match="drop --no-create-attention-mask-in-dataloader"):
        parse_args(
            BASE + "--mock-data --reset-attention-mask --no-create-attention-mask-in-dataloader"
            .split(), world_size=1,
        )  # fmt: skip


def _pretrain_gpt():
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("pretrain_gpt", f"{root}/pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DOCS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10], [11, 12, 13]]  # each ends with eod (256) on disk


def _first_sample(tmp_path, flags: list) -> dict:
    """The first training sample pretrain_gpt.py's dataset config gives for ``flags``."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron.training import datasets
    from megatron.training.tokenizer import ByteLevelTokenizer

    tmp_path.mkdir()
    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for doc in DOCS * 4:
        builder.add_document(torch.tensor(doc + [256]), [len(doc) + 1])
    builder.finalize(prefix + ".idx")
    argv = BASE + ["--data-path", prefix, "--split", "100,0,0", "--seq-length", "12", *flags]
    args = parse_args(argv, world_size=1)
    config = _pretrain_gpt().dataset_config(args, ByteLevelTokenizer())
    train, _, _ = datasets.build_train_valid_test_datasets(config, [2, 0, 0])
    return train[0]


def test_document_flags_reach_the_samples(tmp_path):
    """--eod-mask-loss, --reset-position-ids, --reset-attention-mask through pretrain_gpt.py's
    dataset config: the sample's loss mask, positions and mask follow its document bounds."""
    plain = _first_sample(tmp_path / "plain", [])
    sample = _first_sample(
        tmp_path / "flags", ["--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"]
    )
    tokens = sample["tokens"].tolist()
    assert tokens == plain["tokens"].tolist() and 256 in tokens
    doc = [sum(t == 256 for t in tokens[:i]) for i in range(len(tokens))]  # document of each
    starts = [doc.index(d) for d in doc]
    assert sample["loss_mask"].tolist() == [float(t != 256) for t in tokens]
    assert sample["position_ids"].tolist() == [i - s for i, s in enumerate(starts)]
    masked = sample["attention_mask"][0]  # True: may not attend
    assert masked.tolist() == [
        [not (j <= i and doc[j] == doc[i]) for j in range(len(tokens))] for i in range(len(tokens))
    ]
    assert plain["loss_mask"].tolist() == [1.0] * len(tokens) and "attention_mask" not in plain
    assert plain["position_ids"].tolist() == list(range(len(tokens)))


def test_blend_options_reach_the_dataset_config():
    from megatron.training.tokenizer import ByteLevelTokenizer

    flags = "--mock-data --mid-level-dataset-surplus 0.1 --allow-ambiguous-pad-tokens".split()
    config = _pretrain_gpt().dataset_config(parse_args(BASE + flags, 1), ByteLevelTokenizer())
    assert (config.mid_level_dataset_surplus, config.allow_ambiguous_pad_tokens) == (0.1, True)
    args = parse_args(BASE + ["--mock-data"], 1)
    plain = _pretrain_gpt().dataset_config(args, ByteLevelTokenizer())
    assert (plain.mid_level_dataset_surplus, plain.allow_ambiguous_pad_tokens) == (0.005, False)
    with pytest.raises(ArgumentsError, match="--mid-level-dataset-surplus must be >= 0"):
        parse_args(BASE + "--mock-data --mid-level-dataset-surplus -1".split(), world_size=1)
    with pytest.raises(ArgumentsError, match="not with --mock-data"):
        parse_args(BASE + "--mock-data --per-dataset-sequences-path x.json".split(), 1)


def test_per_dataset_sequences_path_is_checked_and_used(tmp_path):
    """The counts reach megatron-core, which builds the same samples from them; a missing or
    wrong entry is found at start-up against the .idx header."""
    from megatron.training import data_check

    plain = _first_sample(tmp_path / "plain", [])
    prefix = str(tmp_path / "seq" / "docs")
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps({prefix: [20, 21]}))  # 20 one-sequence documents (+1)
    used = _first_sample(tmp_path / "seq", ["--per-dataset-sequences-path", str(counts)])
    assert used["tokens"].tolist() == plain["tokens"].tolist()
    assert data_check.index_counts(prefix) == [20, 21]
    args = parse_args(
        BASE + ["--data-path", prefix, "--per-dataset-sequences-path", str(counts)], world_size=1
    )
    data_check.check_data(args)
    for table, message in (
        ({prefix: [19, 21]}, "is [19, 21], but its index holds [20, 21]"),
        ({"other": [20, 21]}, "has no entry for --data-path prefix"),
        ({prefix: [20]}, "expected {prefix: [sequence count, document count]}"),
    ):
        counts.write_text(json.dumps(table))
        with pytest.raises(data_check.DataError) as err:
            data_check.check_data(args)
        assert message in str(err.value)
