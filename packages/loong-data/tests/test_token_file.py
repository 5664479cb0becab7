import json
import pickle
from pathlib import Path

import pytest

from loong_data import TextTokenizer, TokenFile, prepare_text_dataset


@pytest.fixture
def prepared(corpus_dir: Path, tokenizer: TextTokenizer, tmp_path: Path) -> Path:
    prepare_text_dataset(corpus_dir, tokenizer, tmp_path / "out")
    return tmp_path / "out"


def _edit_index(path: Path, **changes: object) -> None:
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def test_reader(prepared: Path) -> None:
    tf = TokenFile(prepared / "train")
    assert len(tf.tokens) == tf.num_tokens == tf.doc_offsets[-1] == len(tf)
    assert tf.doc_offsets[0] == 0 and tf.num_docs == len(tf.doc_offsets) - 1
    # The .bin or .idx.json path works as well as the prefix.
    assert TokenFile(prepared / "train.bin").num_tokens == TokenFile(prepared / "train.idx.json").num_tokens


def test_pickle_reopens_instead_of_copying(prepared: Path) -> None:
    tf = TokenFile(prepared / "train")
    blob = pickle.dumps(tf)
    assert len(blob) < tf.num_tokens  # the tokens themselves are not in the pickle
    assert pickle.loads(blob).tokens[:100].tolist() == tf.tokens[:100].tolist()


def test_missing_index(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=rf"token index not found: {tmp_path / 'train.idx.json'}"):
        TokenFile(tmp_path / "train")


def test_missing_bin(prepared: Path) -> None:
    (prepared / "train.bin").unlink()
    with pytest.raises(FileNotFoundError, match=rf"token file not found: {prepared / 'train.bin'}"):
        TokenFile(prepared / "train")


def test_truncated_bin(prepared: Path) -> None:
    bin_path = prepared / "train.bin"
    size = bin_path.stat().st_size
    with bin_path.open("r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(ValueError, match=rf"{bin_path} has {size - 10} bytes, expected {size}"):
        TokenFile(prepared / "train")


def test_bin_of_other_index(prepared: Path) -> None:
    (prepared / "val.bin").replace(prepared / "train.bin")
    with pytest.raises(ValueError, match="truncated or does not belong to this index"):
        TokenFile(prepared / "train")


def test_bad_index_json(prepared: Path) -> None:
    idx = prepared / "train.idx.json"
    idx.write_text('{"format": "loong-tokens", "vers', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"token index {idx} is not valid JSON"):
        TokenFile(prepared / "train")
    idx.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match="expected a JSON object with format 'loong-tokens'"):
        TokenFile(prepared / "train")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"version": 99}, "unknown version 99"),
        ({"dtype": "int8"}, r"dtype 'int8', expected one of \['uint16', 'uint32'\]"),
        ({"dtype": "uint32"}, "bytes, expected"),  # the .bin holds uint16: its size gives it away
        ({"num_tokens": -1}, "num_tokens -1"),
        ({"doc_offsets": [0, 5, 3]}, "doc_offsets must be non-decreasing"),
    ],
)
def test_invalid_index_fields(prepared: Path, changes: dict[str, object], message: str) -> None:
    idx = prepared / "train.idx.json"
    _edit_index(idx, **changes)
    with pytest.raises(ValueError, match=message) as info:
        TokenFile(prepared / "train")
    assert str(prepared / "train") in str(info.value)


def test_corrupt_cache_is_rebuilt(corpus_dir: Path, tokenizer: TextTokenizer, prepared: Path) -> None:
    with (prepared / "val.bin").open("r+b") as f:
        f.truncate(4)
    corpus = prepare_text_dataset(corpus_dir, tokenizer, prepared)
    assert not corpus.reused and corpus.val.bin_path.stat().st_size == corpus.val.num_tokens * 2
