import json
from pathlib import Path

import numpy as np
import pytest

from loong_data import DataError, TextTokenizer, TokenFile, prepare_text_dataset


def _docs(tf: TokenFile) -> list[list[int]]:
    return [tf.tokens[a:b].tolist() for a, b in zip(tf.doc_offsets[:-1], tf.doc_offsets[1:])]


def _write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_prepare_folder(corpus_dir: Path, tokenizer: TextTokenizer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    corpus = prepare_text_dataset(corpus_dir, tokenizer, out, val_fraction=0.3, seed=1)
    assert not corpus.reused
    assert {p.name for p in out.iterdir()} == {"train.bin", "train.idx.json", "val.bin", "val.idx.json"}
    assert corpus.train.dtype == "uint16" and corpus.train.tokens.dtype == np.uint16
    assert corpus.train.num_docs + corpus.val.num_docs == 3 and corpus.val.num_docs == 1
    # Every document is the tokenised text of one file plus EOD, none lost or cut.
    expected = sorted(tokenizer.encode(p.read_text(encoding="utf-8")) + [tokenizer.eod_id]
                      for p in corpus_dir.iterdir())
    assert sorted(_docs(corpus.train) + _docs(corpus.val)) == expected
    meta = json.loads((out / "train.idx.json").read_text())
    assert meta["version"] == 1 and meta["num_tokens"] == corpus.train.num_tokens
    assert meta["fingerprint"] == corpus.fingerprint


def test_cache_hit_does_not_rewrite(corpus_dir: Path, tokenizer: TextTokenizer, tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = prepare_text_dataset(corpus_dir, tokenizer, out)
    stamps = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    second = prepare_text_dataset(corpus_dir, tokenizer, out)
    assert second.reused and second.fingerprint == first.fingerprint
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == stamps

    # Editing one byte of one source changes the fingerprint and re-tokenises.
    source = next(iter(sorted(corpus_dir.iterdir())))
    source.write_text(source.read_text(encoding="utf-8") + "!", encoding="utf-8")
    third = prepare_text_dataset(corpus_dir, tokenizer, out)
    assert not third.reused and third.fingerprint != first.fingerprint
    # So do the split settings.
    assert prepare_text_dataset(corpus_dir, tokenizer, out, seed=7).fingerprint != third.fingerprint


def test_split_disjoint_and_deterministic(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    # 50 distinct documents, each a unique line, so a document identifies itself.
    src = _write_jsonl(tmp_path / "docs.jsonl", [{"text": f"Line {i} of the play."} for i in range(50)])
    a = prepare_text_dataset([src], tokenizer, tmp_path / "a", val_fraction=0.1, seed=3)
    b = prepare_text_dataset([src], tokenizer, tmp_path / "b", val_fraction=0.1, seed=3)
    c = prepare_text_dataset([src], tokenizer, tmp_path / "c", val_fraction=0.1, seed=4)
    val_a = {tuple(d) for d in _docs(a.val)}
    train_a = {tuple(d) for d in _docs(a.train)}
    assert len(val_a) == 5 and len(train_a) == 45 and not val_a & train_a
    assert _docs(a.val) == _docs(b.val) and _docs(a.train) == _docs(b.train)
    assert {tuple(d) for d in _docs(c.val)} != val_a
    assert all(d[-1] == tokenizer.eod_id for d in _docs(a.train) + _docs(a.val))


def test_at_least_one_val_document(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "two.jsonl", [{"text": "one"}, {"text": "two"}])
    corpus = prepare_text_dataset(src, tokenizer, tmp_path / "out", val_fraction=0.01)
    assert corpus.train.num_docs == 1 and corpus.val.num_docs == 1


def test_single_document_splits_token_stream(corpus_dir: Path, tokenizer: TextTokenizer, tmp_path: Path) -> None:
    src = corpus_dir / "lovers_complaint_gut.txt"
    corpus = prepare_text_dataset([src], tokenizer, tmp_path / "out", val_fraction=0.1)
    ids = tokenizer.encode(src.read_text(encoding="utf-8")) + [tokenizer.eod_id]
    assert corpus.train.tokens.tolist() + corpus.val.tokens.tolist() == ids
    assert corpus.val.num_tokens == round(len(ids) * 0.1)


def test_txt_and_jsonl_mixed(corpus_dir: Path, tokenizer: TextTokenizer, tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "extra.jsonl", [{"text": "Exit, pursued by a bear.", "id": 1}])
    (tmp_path / "blank.jsonl").write_text("\n", encoding="utf-8")
    corpus = prepare_text_dataset([corpus_dir / "phoenix_and_the_turtle_gut.txt", src, tmp_path / "blank.jsonl"],
                                  tokenizer, tmp_path / "out", val_fraction=0)
    assert corpus.train.num_docs == 2 and corpus.val.num_tokens == 0 and len(corpus.val.tokens) == 0
    assert _docs(corpus.train)[1] == tokenizer.encode("Exit, pursued by a bear.") + [tokenizer.eod_id]


def test_jsonl_without_text_names_file_and_line(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    src = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"content": "no text field"}])
    with pytest.raises(ValueError, match=rf'{src}:2: expected a JSON object with a "text" field'):
        prepare_text_dataset(src, tokenizer, tmp_path / "out")
    src.write_text('{"text": "fine"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{src}:2: invalid JSON"):
        prepare_text_dataset(src, tokenizer, tmp_path / "out")


def test_non_utf8_source_names_file_and_offset(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    binary = tmp_path / "weights.txt"
    binary.write_bytes(b"fine start \xb3\x00\xff")
    with pytest.raises(DataError, match=rf"^{binary}: not UTF-8 text \(byte 0xb3 at offset 11\)"):
        prepare_text_dataset(binary, tokenizer, tmp_path / "out")
    lines = tmp_path / "lines.jsonl"
    lines.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=rf"^{lines}:2: not UTF-8 text"):
        prepare_text_dataset(lines, tokenizer, tmp_path / "out")


def test_missing_and_unsupported_sources(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="source not found: .*missing.txt"):
        prepare_text_dataset([tmp_path / "missing.txt"], tokenizer, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .txt or .jsonl files in folder"):
        prepare_text_dataset(tmp_path / "empty", tokenizer, tmp_path / "out")
    (tmp_path / "notes.md").write_text("x", encoding="utf-8")
    with pytest.raises(ValueError, match="unsupported source .*notes.md"):
        prepare_text_dataset([tmp_path / "notes.md"], tokenizer, tmp_path / "out")


def test_interrupted_write_leaves_no_complete_index(corpus_dir: Path, tokenizer: TextTokenizer,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "out"
    # A finished run exists; then a second run over other sources dies midway.
    prepare_text_dataset(corpus_dir, tokenizer, out)
    records = [{"text": f"document {i}"} for i in range(20)]
    records[12] = {"text": ["not", "a", "string"]}  # fails after 12 documents were written
    src = _write_jsonl(tmp_path / "broken.jsonl", records)
    with pytest.raises(ValueError, match=rf"{src}:13: document text must be a string, got list"):
        prepare_text_dataset(src, tokenizer, out)
    # The old outputs are still a consistent pair (the failure happened before anything was
    # published), no temp files remain, and the broken sources are never taken as prepared.
    assert sorted(p.name for p in out.iterdir()) == ["train.bin", "train.idx.json", "val.bin", "val.idx.json"]
    assert TokenFile(out / "train").fingerprint == TokenFile(out / "val").fingerprint

    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match="must be a string"):
        prepare_text_dataset(src, tokenizer, fresh)
    assert list(fresh.iterdir()) == []
