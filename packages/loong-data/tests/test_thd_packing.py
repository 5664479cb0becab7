"""Document samples, packing strategies and the packed (THD) collate."""

from pathlib import Path

import numpy as np
import pytest
import torch

from loong_data import (
    DocumentDataset,
    FirstFitDecreasing,
    LogNormalLengths,
    SequentialPacking,
    TextTokenizer,
    collate_packed,
    packing_strategy,
    padding_fraction,
    prepare_text_dataset,
)


@pytest.fixture
def train_file(corpus_dir: Path, tokenizer: TextTokenizer, tmp_path: Path):
    return prepare_text_dataset(corpus_dir, tokenizer, tmp_path / "out", val_fraction=0, progress=False).train


def test_document_samples_cover_every_pair_once_and_never_cross_documents(train_file) -> None:
    ds = DocumentDataset(train_file, max_length=128, lengths=LogNormalLengths(median=40, sigma=1.0), seed=3)
    offsets = train_file.doc_offsets
    assert len(ds) > 3 and ds.lengths.min() >= 1 and ds.lengths.max() <= 128
    assert len(np.unique(ds.lengths)) > 20  # really variable
    # Every (input, label) pair of every document appears once: inputs are all tokens but the EODs.
    covered = np.concatenate([np.arange(s, s + n) for s, n in zip(ds.starts, ds.lengths)])
    expected = np.concatenate([np.arange(offsets[d], offsets[d + 1] - 1) for d in range(train_file.num_docs)])
    assert np.array_equal(np.sort(covered), expected)
    doc_of = np.searchsorted(offsets, ds.starts, side="right") - 1
    assert np.all(ds.starts + ds.lengths <= offsets[doc_of + 1] - 1)  # last label is at most the EOD
    stream = torch.from_numpy(train_file.tokens.astype(np.int64))
    s = ds[5]
    start, n = int(ds.starts[5]), int(ds.lengths[5])
    assert torch.equal(s["tokens"], stream[start : start + n]) and torch.equal(s["labels"], stream[start + 1 : start + n + 1])
    assert torch.equal(s["position_ids"], torch.arange(n)) and bool((s["loss_mask"] == 1).all())
    # Seeded: same seed, same cuts; another seed, other cuts.
    again = DocumentDataset(train_file, max_length=128, lengths=LogNormalLengths(median=40, sigma=1.0), seed=3)
    assert np.array_equal(again.starts, ds.starts)
    other = DocumentDataset(train_file, max_length=128, lengths=LogNormalLengths(median=40, sigma=1.0), seed=4)
    assert not np.array_equal(other.starts, ds.starts)


def test_whole_documents_are_cut_only_at_max_length(train_file) -> None:
    ds = DocumentDataset(train_file, max_length=1000)
    sizes = np.diff(train_file.doc_offsets) - 1
    assert len(ds) == int(np.sum(-(-sizes // 1000)))
    assert np.sum(ds.lengths == 1000) == len(ds) - train_file.num_docs


def test_long_fraction_produces_a_tail_at_max_length() -> None:
    lengths = LogNormalLengths(median=50, sigma=0.5, long_fraction=0.1).sample(np.random.default_rng(0), 10_000, 4096)
    assert 0.08 < np.mean(lengths == 4096) < 0.12 and np.median(lengths) < 100


@pytest.mark.parametrize("strategy", [FirstFitDecreasing(), FirstFitDecreasing(buffer_size=7), SequentialPacking()],
                         ids=["ffd", "ffd-buffer7", "sequential"])
def test_strategies_place_every_sample_once_within_capacity(strategy) -> None:
    lengths = np.random.default_rng(1).integers(1, 101, size=200).tolist()
    packs = strategy.pack(lengths, 100)
    assert sorted(i for p in packs for i in p) == list(range(200))
    assert all(sum(lengths[i] for i in p) <= 100 for p in packs)
    assert strategy.pack(lengths, 100) == packs  # deterministic


def test_ffd_pads_less_than_sequential_and_padding_fraction_is_exact() -> None:
    lengths = [60, 50, 50, 40, 30, 20, 10, 40]
    seq = SequentialPacking().pack(lengths, 100)
    ffd = FirstFitDecreasing().pack(lengths, 100)
    assert seq == [[0], [1, 2], [3, 4, 5, 6], [7]]
    assert padding_fraction(lengths, seq, 100) == pytest.approx(1 - 300 / 400)
    assert len(ffd) == 3 and padding_fraction(lengths, ffd, 100) == pytest.approx(0.0)
    long_tail = LogNormalLengths(median=200, sigma=1.0).sample(np.random.default_rng(0), 2000, 4096).tolist()
    pad_ffd = padding_fraction(long_tail, packing_strategy("ffd").pack(long_tail, 4096), 4096)
    pad_seq = padding_fraction(long_tail, packing_strategy("sequential").pack(long_tail, 4096), 4096)
    assert pad_ffd < 0.01 < pad_seq


def test_strategy_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="sample 1 has length 101"):
        FirstFitDecreasing().pack([5, 101], 100)
    with pytest.raises(ValueError, match="allowed: ffd, sequential"):
        packing_strategy("best")


def test_collate_packed_builds_cu_seqlens_positions_and_padding() -> None:
    def sample(n: int, first: int) -> dict[str, torch.Tensor]:
        t = torch.arange(first, first + n + 1)
        return {"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(n), "position_ids": torch.arange(n)}

    batch = collate_packed([sample(3, 10), sample(2, 20)], capacity=8, pad_id=1)
    assert batch["tokens"].tolist() == [[10, 11, 12, 20, 21, 1, 1, 1]]
    assert batch["labels"].tolist() == [[11, 12, 13, 21, 22, 1, 1, 1]]
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].tolist() == [0, 3, 5, 8]
    assert batch["max_seqlen"] == 3
    exact = collate_packed([sample(3, 10), sample(2, 20)])
    assert exact["tokens"].shape == (1, 5) and exact["cu_seqlens"].tolist() == [0, 3, 5]
    with pytest.raises(ValueError, match="more than the pack capacity 4"):
        collate_packed([sample(3, 10), sample(2, 20)], capacity=4)
