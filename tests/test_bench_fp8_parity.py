"""The plumbing of bench/fp8_parity.py on the CPU: an HF Llama directory becomes a Loong model
YAML, the train app starts from it once per variant on the same data and seed, and the tail means
are compared against the bound (FP8 itself needs a GPU: here every variant runs in BF16)."""

import json
from pathlib import Path

import pytest

from loong_ckpt.testing.hf_models import make_hf_model
from loong_train.testing import load_script

_PATH = Path(__file__).parents[1] / "bench" / "fp8_parity.py"
bench = load_script(_PATH)


def test_two_runs_from_one_hf_checkpoint_with_the_same_seed_give_the_same_tail_mean(tmp_path, capsys):
    hf = make_hf_model(tmp_path / "tiny-llama", "llama", vocab=8192, tie=True)  # the bundled 8K tokenizer
    argv = ["--hf-dir", str(hf), "--workdir", str(tmp_path / "work"), "--steps", "3", "--tail", "2",
            "--seq", "32", "--mbs", "2", "--bound", "0", "--variants", "again=fp8=off"]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["failed"] == [] and result["means"]["again"] == result["means"]["bf16"]
    yaml = (tmp_path / "work" / "configs" / "model" / "foundation" / "parity-model.yaml").read_text()
    assert "hidden_size: 64" in yaml and "tie_word_embeddings: true" in yaml  # derived from config.json
    rows = [json.loads(r) for r in (tmp_path / "work" / "again" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("split", "train") == "train"] == [1, 2, 3]


def test_a_variant_out_of_the_bound_fails_and_is_named(capsys):
    assert bench.compare({"bf16": 3.10, "adaptive": 3.115, "on": 3.13}, 0.02) == ["on"]
    out = capsys.readouterr().out
    assert "adaptive     3.1150  diff +0.0150" in out and "-> OUT OF BOUND" in out
    with pytest.raises(SystemExit, match="non-finite loss at steps \\[2\\]"):
        bench.tail_mean([3.0, float("nan"), 3.0], 2, "on")


def test_bad_arguments_are_refused():
    assert bench.parse_args([]).parsed_variants == [("adaptive", {"fp8": "adaptive", "recipe": "blockwise"})]
    with pytest.raises(SystemExit, match="expected label=key=value"):
        bench.parse_args(["--variants", "x=dtype=fp8"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "10", "--tail", "20"])
