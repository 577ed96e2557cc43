"""GPT datasets through megatron-core's builder: --data-path blends, --split, mock data, samples
of seq_length + 1 tokens from the preprocessed stdlib corpus, the consumed-samples sampler
(resume continues exactly), get_batch, and the guard against an empty split."""

import numpy
import pytest
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron.training import corpus
from megatron.training import datasets as D
from megatron.training.tokenizer import ByteLevelTokenizer, NullTokenizer

EOD = 256
SEQ = 32


def write_tagged(prefix: str, n_docs: int, tag=None) -> str:
    """n_docs documents; document i holds its tag (i, or a fixed ``tag``) 3..9 times, then eod,
    so every token says which document (or dataset) a sample came from."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(EOD + 1))
    for i in range(n_docs):
        doc = [i if tag is None else tag] * (3 + i % 7) + [EOD]
        builder.add_document(numpy.array(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    return write_tagged(str(tmp_path_factory.mktemp("tagged") / "docs"), 200)


def build(data_path, samples, split="8,1,1", **kwargs):
    config = D.gpt_dataset_config(
        ByteLevelTokenizer(), SEQ, seed=7, data_path=data_path, split=split, **kwargs
    )
    return D.build_train_valid_test_datasets(config, samples)


def tokens_of(dataset) -> set[int]:
    return {int(t) for i in range(len(dataset)) for t in dataset[i]["tokens"]} - {EOD}


PARSE_CASES = [
    ("prefA", (["prefA"], None)),
    ("prefA prefB", (["prefA", "prefB"], None)),
    ("0.3 prefA 0.7 prefB", (["prefA", "prefB"], [0.3, 0.7])),
    (["30", "prefA", "70", "prefB"], (["prefA", "prefB"], [30.0, 70.0])),
    (["prefA"], (["prefA"], None)),
    (None, None),
    ([], None),
]


@pytest.mark.parametrize("data_path, blend", PARSE_CASES)
def test_parse_data_path(data_path, blend):
    assert D.parse_data_path(data_path) == blend


@pytest.mark.parametrize(
    "data_path, message",
    [("0.3 prefA prefB", "weights and prefixes must alternate"),
     ("0.3 prefA prefB 0.7", "weights and prefixes must alternate"),
     ("0 prefA 1 prefB", "every weight must be finite and > 0")],
)  # fmt: skip
def test_parse_data_path_errors(data_path, message):
    with pytest.raises(ValueError, match=message):
        D.parse_data_path(data_path)


def test_missing_prefix_and_missing_data_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match=r"--data-path prefix '.*nope': no .*nope.bin"):
        build(str(tmp_path / "nope"), [8, 8, 8])
    with pytest.raises(ValueError, match="pass --data-path .* or --mock-data"):
        build(None, [8, 8, 8])


def test_num_samples_as_megatron_counts_them():
    # 10 iters x 8 = 80 train; evaluations at 5, 10 and the end = 3 x 2 iters x 8; test 2 x 8.
    assert D.train_valid_test_num_samples(10, 8, 5, 2) == [80, 48, 16]
    assert D.train_valid_test_num_samples(10, 8, 5, 2, train_samples=100) == [100, 48, 16]


def test_split_gives_disjoint_document_ranges(tagged, tmp_path):
    train, valid, test = build(tagged, [64, 16, 16], data_cache_path=str(tmp_path))
    # '8,1,1' of 200 documents: [0, 160), [160, 180), [180, 200), each sampled within its range.
    for ds, (lo, hi) in zip((train, valid, test), ((0, 160), (160, 180), (180, 200))):
        assert isinstance(ds, GPTDataset)
        assert ds.indices.tolist() == list(range(lo, hi))
        assert tokens_of(ds) <= set(range(lo, hi)) and len(tokens_of(ds)) > (hi - lo) // 2


def test_zero_split_builds_no_dataset(tagged, tmp_path):
    train, valid, test = build(tagged, [64, 0, 0], split="1,0,0", data_cache_path=str(tmp_path))
    assert isinstance(train, GPTDataset) and valid is None and test is None
    assert train.indices.tolist() == list(range(200))


def test_blend_weights(tmp_path):
    a = write_tagged(str(tmp_path / "a"), 50, tag=10)
    b = write_tagged(str(tmp_path / "b"), 50, tag=20)
    train, _, _ = build(f"0.3 {a} 0.7 {b}", [1000, 0, 0], split="1,0,0",
                        data_cache_path=str(tmp_path / "cache"))  # fmt: skip
    assert isinstance(train, BlendedDataset) and len(train) == 1000
    # megatron-core's blending index is greedy: each prefix is within one sample of its share.
    counts = numpy.bincount(train.dataset_index, minlength=2)
    assert abs(counts[0] - 300) <= 1 and abs(counts[1] - 700) <= 1
    for i in range(0, 1000, 97):
        tag = 10 if train.dataset_index[i] == 0 else 20
        assert set(train[i]["tokens"].tolist()) <= {tag, EOD}


def test_corpus_samples_are_seq_length_plus_one(tmp_path):
    prefix = corpus.build_corpus(str(tmp_path), 300_000)
    train, valid, test = build(prefix, [40, 8, 8], split="80,10,10", data_cache_path=str(tmp_path))
    for ds in (train, valid, test):
        assert len(ds) >= 8
        text, _ = ds._query_document_sample_shuffle_indices(3)
        assert len(text) == SEQ + 1  # the extra token makes the labels of the last input
        sample = ds[3]
        assert torch.equal(sample["tokens"], torch.from_numpy(text[:-1]).long())
        assert torch.equal(sample["labels"], torch.from_numpy(text[1:]).long())
        assert sample["position_ids"].tolist() == list(range(SEQ))
        assert sample["loss_mask"].sum().item() == SEQ  # eod_mask_loss is off
        assert "attention_mask" not in sample  # models build causal masks themselves


def test_mock_data():
    config = D.gpt_dataset_config(NullTokenizer(100), SEQ, seed=3, mock_data=True)
    train, valid, test = D.build_train_valid_test_datasets(config, [50, 10, 10])
    assert all(isinstance(ds, MockGPTDataset) for ds in (train, valid, test))
    assert len(train) >= 50
    sample = train[0]
    assert sample["tokens"].shape == (SEQ,) and int(sample["tokens"].max()) <= 100
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])


def test_empty_split_is_an_error_not_a_hang(tmp_path):
    small = write_tagged(str(tmp_path / "small"), 48)
    # '969,30,1' of 48 documents leaves test [48, 48): megatron-core would loop forever.
    with pytest.raises(ValueError, match="leaves the test split .* empty, but 16 test samples"):
        build(small, [80, 48, 16], split="969,30,1", data_cache_path=str(tmp_path))


SAMPLER_CASES = [  # total, consumed, micro batch, dp size
    (100, 0, 4, 1), (100, 12, 4, 1), (100, 0, 2, 4), (100, 24, 2, 4), (37, 5, 3, 2),
]  # fmt: skip


def batches(total, consumed, mbs, dp, rank, drop_last=True):
    return list(D.MegatronPretrainingSampler(total, consumed, mbs, rank, dp, drop_last))


@pytest.mark.parametrize("total, consumed, mbs, dp", SAMPLER_CASES)
def test_sampler_ranks_cover_global_batches_in_order(total, consumed, mbs, dp):
    per_rank = [batches(total, consumed, mbs, dp, r) for r in range(dp)]
    steps = (total - consumed) // (mbs * dp)
    assert all(len(b) == steps for b in per_rank)
    for step in range(steps):
        merged = [i for r in range(dp) for i in per_rank[r][step]]
        start = consumed + step * mbs * dp
        assert merged == list(range(start, start + mbs * dp))


@pytest.mark.parametrize("total, consumed, mbs, dp", SAMPLER_CASES)
def test_sampler_resume_continues_exactly(total, consumed, mbs, dp):
    for rank in range(dp):
        full = batches(total, consumed, mbs, dp, rank)
        for done in range(len(full)):
            resumed = batches(total, consumed + done * mbs * dp, mbs, dp, rank)
            assert resumed == full[done:]


def test_sampler_keeps_the_last_partial_batch_only_if_asked():
    assert batches(10, 0, 4, 1, 0) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert batches(10, 0, 4, 1, 0, drop_last=False)[-1] == [8, 9]


@pytest.mark.parametrize(
    "args, message",
    [((0, 0, 4, 0, 1), "total_samples must be > 0"), ((10, 10, 4, 0, 1), r"consumed_samples"),
     ((10, 0, 0, 0, 1), "micro_batch_size must be > 0"), ((10, 0, 4, 2, 2), "data_parallel_rank")],
)  # fmt: skip
def test_sampler_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        D.MegatronPretrainingSampler(*args)


def test_data_loader_resume_and_get_batch(tagged, tmp_path):
    train, _, _ = build(tagged, [64, 16, 16], data_cache_path=str(tmp_path))
    run = iter(D.build_pretraining_data_loader(train, 0, micro_batch_size=4))
    first = [D.get_batch(run, 4, SEQ) for _ in range(5)]
    resumed = iter(D.build_pretraining_data_loader(train, 3 * 4, micro_batch_size=4))
    again = [D.get_batch(resumed, 4, SEQ) for _ in range(2)]
    for old, new in zip(first[3:], again):
        assert all(torch.equal(a, b) for a, b in zip(old, new) if a is not None)
    tokens, labels, loss_mask, attention_mask, position_ids = first[0]
    assert tokens.shape == labels.shape == loss_mask.shape == position_ids.shape == (4, SEQ)
    assert attention_mask is None
    assert torch.equal(tokens, torch.stack([train[i]["tokens"] for i in range(4)]))


def test_get_batch_with_dataloader_attention_mask(tagged, tmp_path):
    train, _, _ = build(tagged, [8, 8, 8], data_cache_path=str(tmp_path),
                        create_attention_mask_in_dataloader=True)  # fmt: skip
    batch = D.get_batch(iter(D.build_pretraining_data_loader(train, 0, 2)), 2, SEQ)
    assert batch[3].shape == (2, 1, SEQ, SEQ) and batch[3].dtype == torch.bool
    # True marks masked positions: strictly above the diagonal.
    assert torch.equal(batch[3][0, 0], torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1))
