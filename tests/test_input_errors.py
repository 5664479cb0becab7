"""Bad input to the train app fails in one line that names the key, file or line, never with a
stack trace (each case runs the real `train` command, so Hydra's own reporting is covered)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

CHAT = {"messages": [{"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": "A player."}]}


def _one_line_error(run, *expected: str) -> str:
    assert run.returncode != 0, run.stdout[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith(("config error:", "error:"))]
    assert len(lines) == 1, run.stderr[-4000:]
    assert "Traceback" not in run.stderr and "HYDRA_FULL_ERROR" not in run.stderr, run.stderr[-4000:]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def _bad_inputs(root: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    binary = root / "weights.txt"
    binary.write_bytes(b"Enter Hamlet.\n" + bytes(range(128, 256)) * 8)
    short = root / "short.txt"
    short.write_text("Exeunt.", encoding="utf-8")
    chat = root / "chat.jsonl"
    chat.write_text(json.dumps(CHAT) + '\n{"messages": [oops\n', encoding="utf-8")
    return {
        "binary source": ([f"data.sources=[{binary}]"], (f"{binary}: not UTF-8 text (byte 0x80 at offset 14)",)),
        "short corpus": (
            [f"data.sources=[{short}]", "data.val_fraction=0.5"],
            (f"{short}: the ", " split has ", "one sample of seq_length 64 needs 65"),
        ),
        "malformed chat line": (
            ["phase=sft", f"data.sources=[{chat}]", "data.tokenizer=null"],
            (f"{chat}:2: expected a JSON object with 'messages'",),
        ),
    }


def test_bad_inputs_fail_in_one_line_naming_the_culprit(run_train, tmp_path):
    for name, (overrides, expected) in _bad_inputs(tmp_path).items():
        run = run_train([*overrides, "train.steps=1"], name=name.replace(" ", "-"))
        _one_line_error(run, *expected)
        assert not (run.out_dir / "checkpoints").exists(), name


def _tiny_hf_dir(path: Path) -> Path:
    """A random HF Llama of the TINY test model's shape; its rms_norm_eps as a float32 reads back
    (9.999999747378752e-06, as real checkpoints such as SmolLM2's have it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=8192, max_position_embeddings=2048,
                         rms_norm_eps=9.999999747378752e-06, tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_init_from_an_hf_dir_fine_tunes_or_fails_in_one_line(run_train, tmp_path):
    hf = _tiny_hf_dir(tmp_path / "hf")
    run = run_train([f"train.init_from={hf}", "train.steps=3", "train.save_final=false"]).check()
    # the fine-tuning recipe is chosen and said; the user's optim.warmup_steps=2 (TINY) still holds
    assert f"train.init_from={hf} starts from trained weights: fine-tuning recipe phase=finetune" in run.stderr
    lrs = {r["step"]: r["lr"] for r in run.records("train")}
    # the rate each step ran at: warm-up 1e-4 * s / 2, then min_lr at the last step
    assert [round(lrs[s], 12) for s in (1, 2, 3)] == [5e-5, 1e-4, 1e-5], lrs

    run = run_train([f"train.init_from={hf}", "model.foundation.num_layers=3", "train.steps=1"], name="other")
    line = _one_line_error(run, f"{hf / 'config.json'} describes a different model")
    assert "num_layers" in line


def test_a_skipped_bad_image_names_the_users_jsonl_file_and_line(tmp_path, caplog):
    from loong_data import default_multimodal_dataset
    from loong_data.step_data import MultimodalDataConfig
    from loong_data.step_data.shards import convert_sources

    bundled = default_multimodal_dataset()
    (tmp_path / "broken.png").write_bytes(b"\x89PNG but not really")
    good = json.loads((bundled / "conversations.jsonl").read_text().splitlines()[0])
    good["messages"][0]["content"][0]["image"] = str(bundled / good["messages"][0]["content"][0]["image"])
    bad = json.loads(json.dumps(good))
    bad["messages"][0]["content"][0]["image"] = "broken.png"
    user = tmp_path / "mine.jsonl"
    user.write_text("\n".join(json.dumps(r) for r in (good, good, bad)) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        out = convert_sources(MultimodalDataConfig(jsonl=[str(user)]), tmp_path / "cache", seed=0)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert skipped and all(f"{user}:3: " in m for m in skipped), skipped
    assert "broken.png" in skipped[0]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_samples"] == 2 and manifest["num_skipped"] == 1 and manifest["inputs"] == [str(user)]


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.stepz=3", "config error: train.stepz: no key 'stepz' in train; did you mean train.steps? allowed: steps,"),
        ("model.foundaton.num_layers=2", "config error: model.foundaton.num_layers: no key 'foundaton' in model; "
                                         "did you mean model.foundation?"),
        ("phse=sft", "config error: phse: no key 'phse' in the top level; did you mean phase?"),
    ],
)  # fmt: skip
def test_a_misspelt_key_fails_in_one_line_with_the_closest_key(monkeypatch, override, expected):
    from loong_train.main import main

    monkeypatch.setattr("sys.argv", ["train", override])
    with pytest.raises(SystemExit) as e:
        main()  # the check runs before Hydra composes anything
    assert str(e.value.code).startswith(expected) and "\n" not in str(e.value.code), e.value.code


@pytest.mark.parametrize("args", [["--cfg", "job", "model=tiny"], ["phase=sft", "+model.foundation.extra.x=1"]])
def test_valid_overrides_pass_the_key_check(args):
    from loong_models.overrides import check_overrides
    from loong_train.main import CONFIG_PACKAGES
    from loong_train.schema import Config

    assert check_overrides(args, Config, CONFIG_PACKAGES) is None
