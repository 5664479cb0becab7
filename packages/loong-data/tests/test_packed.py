from pathlib import Path

import pytest
import torch

from loong_data import DataError, PackedTextDataset, TextTokenizer, collate, prepare_text_dataset


def test_samples_are_shifted_windows(corpus_dir: Path, tokenizer: TextTokenizer, tmp_path: Path) -> None:
    corpus = prepare_text_dataset(corpus_dir, tokenizer, tmp_path / "out", val_fraction=0)
    seq_length = 64
    ds = PackedTextDataset(corpus.train, seq_length)
    stream = torch.from_numpy(corpus.train.tokens.astype("int64"))
    assert len(ds) == (corpus.train.num_tokens - 1) // seq_length
    for i in (0, 1, len(ds) - 1):
        s = ds[i]
        assert set(s) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert all(v.shape == (seq_length,) for v in s.values())
        assert s["tokens"].dtype == s["labels"].dtype == s["position_ids"].dtype == torch.long
        assert s["loss_mask"].dtype == torch.float32 and bool((s["loss_mask"] == 1).all())
        assert torch.equal(s["tokens"], stream[i * seq_length : (i + 1) * seq_length])
        assert torch.equal(s["labels"], stream[i * seq_length + 1 : (i + 1) * seq_length + 1])
        assert torch.equal(s["position_ids"], torch.arange(seq_length))
    # Consecutive samples chain: the last label of one is the first token of the next.
    assert ds[0]["labels"][-1] == ds[1]["tokens"][0]
    # The EOD of the first document sits inside the packed stream.
    first_doc_end = int(corpus.train.doc_offsets[1]) - 1
    assert stream[first_doc_end] == tokenizer.eod_id
    with pytest.raises(IndexError):
        ds[len(ds)]

    batch = collate([ds[0], ds[3]])
    assert {k: tuple(v.shape) for k, v in batch.items()} == dict.fromkeys(batch, (2, seq_length))
    assert torch.equal(batch["labels"][1], ds[3]["labels"])


def test_accepts_path_prefix(corpus_dir: Path, tokenizer: TextTokenizer, tmp_path: Path) -> None:
    prepare_text_dataset(corpus_dir, tokenizer, tmp_path / "out")
    assert len(PackedTextDataset(tmp_path / "out" / "train", 128)) > 0


def test_corpus_shorter_than_one_sample_names_the_source_not_the_cache(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    src = tmp_path / "tiny.txt"
    src.write_text("Exeunt.", encoding="utf-8")
    corpus = prepare_text_dataset(src, tokenizer, tmp_path / "out", val_fraction=0)
    with pytest.raises(DataError, match=rf"^{src}: the train split has \d+ tokens, too few: one sample of seq_length 32"):
        PackedTextDataset(corpus.train, seq_length=32)


def test_collate_rejects_mismatched_samples() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        collate([])
    with pytest.raises(ValueError, match="sample 1 has keys"):
        collate([{"a": torch.zeros(2)}, {"b": torch.zeros(2)}])
