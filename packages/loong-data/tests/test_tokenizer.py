import json
import shutil
from pathlib import Path

import pytest

from loong_data import EOD_TOKEN, PAD_TOKEN, TextTokenizer, default_corpus, default_tokenizer, load_tokenizer


def test_bundled_tokenizer_ids(tokenizer: TextTokenizer) -> None:
    assert tokenizer.vocab_size == 8192
    assert tokenizer.eod_id == 0 and tokenizer.pad_id == 1
    assert tokenizer.encode(EOD_TOKEN) == [tokenizer.eod_id]
    assert tokenizer.encode(PAD_TOKEN) == [tokenizer.pad_id]
    assert tokenizer.path == default_tokenizer()


def test_round_trip_real_text(tokenizer: TextTokenizer) -> None:
    text = (default_corpus() / "sonnets_gut.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    # A BPE trained on this corpus compresses it well below one token per 3 characters.
    assert len(ids) < len(text) / 3
    # Byte-level: text outside the corpus alphabet still round-trips.
    other = "naïve café 東京 🚀\ttab"
    assert tokenizer.decode(tokenizer.encode(other)) == other
    assert tokenizer.decode(tokenizer.encode("To be") + [tokenizer.eod_id]) == "To be" + EOD_TOKEN


def test_folder_is_accepted(tmp_path: Path) -> None:
    shutil.copy(default_tokenizer(), tmp_path / "tokenizer.json")
    assert load_tokenizer(tmp_path).path == tmp_path / "tokenizer.json"


def test_missing_tokenizer_names_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(tmp_path / "nope.json")


def test_tokenizer_without_eod(tmp_path: Path) -> None:
    spec = json.loads(default_tokenizer().read_text(encoding="utf-8"))
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != EOD_TOKEN]
    del spec["model"]["vocab"][EOD_TOKEN]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ValueError, match=r"no end-of-document token '<\|endoftext\|>'") as info:
        load_tokenizer(path)
    assert str(path) in str(info.value)
    # Another EOD token can be named; a missing pad falls back to EOD.
    tok = load_tokenizer(path, eod_token=PAD_TOKEN, pad_token="<|none|>")
    assert tok.eod_id == tok.pad_id == 1


def test_malformed_tokenizer_json(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_tokenizer(path)


def test_training_script_reproduces_bundled_tokenizer(tmp_path: Path) -> None:
    from loong_data.tools.train_tokenizer import main

    out = tmp_path / "tokenizer.json"
    assert main(["--out", str(out)]) == 0
    assert out.read_bytes() == default_tokenizer().read_bytes()


@pytest.mark.parametrize("declared", ["<|endoftext|>", {"content": "<|endoftext|>", "special": True}])
def test_pad_token_comes_from_the_tokenizers_own_config(tmp_path: Path, declared) -> None:
    shutil.copy(default_tokenizer(), tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": declared}), encoding="utf-8")
    tok = load_tokenizer(tmp_path)
    assert tok.pad_id == tok.eod_id == tok.encode("<|endoftext|>")[0]
    assert load_tokenizer(tmp_path, pad_token=PAD_TOKEN).pad_id == tok.encode(PAD_TOKEN)[0]  # asked for: wins
    (tmp_path / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    assert load_tokenizer(tmp_path).pad_id == tok.encode(PAD_TOKEN)[0]  # none declared: <|pad|>
