import json
from pathlib import Path

import pytest

from loong_data import TokenFile
from loong_data.cli import main


def test_tokenize(corpus_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["tokenize", "--out", str(out), "--quiet", str(corpus_dir)]) == 0
    printed = capsys.readouterr().out
    train, val = TokenFile(out / "train"), TokenFile(out / "val")
    assert f"train: {train.num_tokens:,} tokens" in printed and f"val: {val.num_tokens:,} tokens" in printed
    assert main(["tokenize", "--out", str(out), "--quiet", str(corpus_dir)]) == 0
    assert "reused" in capsys.readouterr().out


def test_tokenize_jsonl_with_folder_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loong_data import default_tokenizer

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_bytes(default_tokenizer().read_bytes())
    src = tmp_path / "lines.jsonl"
    src.write_text("".join(json.dumps({"text": f"Enter {i}."}) + "\n" for i in range(10)), encoding="utf-8")
    assert main(["tokenize", "--tokenizer", str(model_dir), "--out", str(tmp_path / "o"), "--quiet",
                 "--val-fraction", "0.2", str(src)]) == 0
    assert "val: " in capsys.readouterr().out and TokenFile(tmp_path / "o" / "val").num_docs == 2


def test_input_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenize", "--out", str(tmp_path / "o"), str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("loong-data tokenize: error: source not found:") and "Traceback" not in err
