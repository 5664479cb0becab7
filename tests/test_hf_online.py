"""The train app starts from an HF directory directly and exports HF weights (loong-ckpt online)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loong_ckpt.testing.hf_models import make_hf_model

# Matches conftest.TINY's model shape; vocab covers the bundled 8k tokenizer.
VOCAB = 8192


@pytest.fixture(scope="module")
def hf_and_ckpt(tmp_path_factory):
    from loong_ckpt import hf_to_mcore

    base = tmp_path_factory.mktemp("online")
    hf = make_hf_model(base / "tiny-qwen2", "qwen2", vocab=VOCAB, max_shard_size="300KB")
    res = hf_to_mcore(hf, base / "ckpt", progress=False)
    return hf, res


def _overrides(res, init_from: Path) -> list[str]:
    return [
        f"hydra.searchpath=[file://{res.path}/configs]", f"model={res.model_name}", f"train.init_from={init_from}",
        "train.steps=1", "train.eval_iters=0",
    ]  # fmt: skip


@pytest.mark.dist
def test_one_step_from_hf_dir_at_tp2_equals_converted_checkpoint_in_one_process(hf_and_ckpt, run_train):
    """Online loading shards the HF weights over TP=2 as it reads them; offline conversion then one
    process gives the same first loss, and the TP=2 run exports the full HF weights."""
    import transformers
    from safetensors.torch import load_file

    hf, res = hf_and_ckpt
    a = run_train([*_overrides(res, hf), "train.export_hf=true", "parallel.tp=2"], nproc=2, name="from-hf").check()
    b = run_train(_overrides(res, res.path), name="from-ckpt").check()
    assert abs(a.losses()[1] - b.losses()[1]) < 1e-4

    # export: HF weights of the trained model, the source's config.json, loadable by transformers
    exported = a.out_dir / "hf" / "step_00000001"
    assert json.loads((exported / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    assert (exported / "tokenizer.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    trained = {}
    for f in exported.glob("*.safetensors"):
        trained.update(load_file(f))
    source = {}
    for f in hf.glob("*.safetensors"):
        source.update(load_file(f))
    assert sorted(trained) == sorted(source)
    changed = [k for k in source if not torch.equal(source[k], trained[k])]
    assert len(changed) > len(source) // 2  # one optimizer step moved the weights
    assert torch.equal(model.model.embed_tokens.weight, trained["model.embed_tokens.weight"])
    meta = json.loads((a.out_dir / "checkpoints" / "step_00000001" / "loong.json").read_text())
    assert meta["foundation"]["family"] == "qwen2" and "hf_config" in meta
