"""Bad input: a clear error naming the file or key, and never an output that looks complete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from loong_ckpt import ConversionError, hf_to_mcore, mcore_to_hf
from loong_ckpt.testing import get_converted


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """converted(family) -> Converted (shared by every module of the session)."""
    return lambda family: get_converted(tmp_path_factory, family)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _nothing_left(out: Path) -> None:
    assert not out.exists(), f"{out} left behind"
    assert not out.with_name(out.name + ".partial").exists()


def test_missing_shard(converted, tmp_path):
    hf = _copy(converted("llama").hf, tmp_path / "hf")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (hf / shard).unlink()
    with pytest.raises(ConversionError, match=f"shard {shard} is listed") as e:
        hf_to_mcore(hf, tmp_path / "out", progress=False)
    assert "model.safetensors.index.json" in str(e.value)
    _nothing_left(tmp_path / "out")


def test_config_does_not_match_weights(converted, tmp_path):
    hf = _copy(converted("qwen2").hf, tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="does not match the weights") as e:
        hf_to_mcore(hf, tmp_path / "out", progress=False)
    msg = str(e.value)
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "(128, 64)" in msg and "(96, 64)" in msg
    _nothing_left(tmp_path / "out")


def test_missing_tensor(converted, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = _copy(converted("qwen3").hf, tmp_path / "hf")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.k_norm.weight"
    shard = hf / index["weight_map"][name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=f"tensor {name}"):
        hf_to_mcore(hf, tmp_path / "out", progress=False)
    _nothing_left(tmp_path / "out")


def test_unsupported_architecture(converted, tmp_path):
    hf = _copy(converted("llama").hf, tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="MistralForCausalLM") as e:
        hf_to_mcore(hf, tmp_path / "out", progress=False)
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in str(e.value)
    _nothing_left(tmp_path / "out")


def test_unsupported_feature_names_the_key(converted, tmp_path):
    hf = _copy(converted("llama").hf, tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConversionError, match="hidden_act='gelu'"):
        hf_to_mcore(hf, tmp_path / "out", progress=False)


def test_non_empty_output_needs_force(converted, tmp_path):
    c = converted("llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty; pass --force"):
        hf_to_mcore(c.hf, out, progress=False)
    with pytest.raises(ConversionError, match="not empty; pass --force"):
        mcore_to_hf(c.ckpt, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    hf_to_mcore(c.hf, out, progress=False, force=True)
    assert (out / "loong.json").is_file() and not (out / "keep.txt").exists()


@pytest.mark.parametrize("direction", ["hf-to-mcore", "mcore-to-hf"])
def test_failure_mid_write_leaves_nothing_complete(direction, converted, tmp_path, monkeypatch):
    """A crash after some tensors are written: no output dir, no partial dir, and an existing
    output (replaced with --force) stays intact."""
    from loong_ckpt import hf_io, mcore_io

    c = converted("llama")
    calls = {"n": 0}
    if direction == "hf-to-mcore":
        orig = hf_io.HFReader.read

        def boom(self, *a, **k):
            calls["n"] += 1
            if calls["n"] > 5:
                raise OSError("disk on fire")
            return orig(self, *a, **k)

        monkeypatch.setattr(hf_io.HFReader, "read", boom)
        run = lambda out, **kw: hf_to_mcore(c.hf, out, progress=False, **kw)  # noqa: E731
    else:
        orig = mcore_io.read_regions

        def boom(*a, **k):
            calls["n"] += 1
            if calls["n"] > 1:
                raise OSError("disk on fire")
            return orig(*a, **k)

        monkeypatch.setattr("loong_ckpt.convert.read_regions", boom)
        run = lambda out, **kw: mcore_to_hf(c.ckpt, out, progress=False, **kw)  # noqa: E731
    with pytest.raises(OSError, match="disk on fire"):
        run(tmp_path / "out")
    _nothing_left(tmp_path / "out")
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "old.txt").write_text("old")
    calls["n"] = 0
    with pytest.raises(OSError, match="disk on fire"):
        run(existing, force=True)
    assert (existing / "old.txt").read_text() == "old"
    assert not existing.with_name("existing.partial").exists()


def test_partial_or_foreign_checkpoint(converted, tmp_path):
    partial = _copy(converted("llama").ckpt, tmp_path / "step_00000010.partial")
    with pytest.raises(ConversionError, match="incomplete checkpoint"):
        mcore_to_hf(partial, tmp_path / "out", progress=False)
    bare = _copy(converted("llama").ckpt, tmp_path / "bare")
    (bare / "loong.json").unlink()
    with pytest.raises(ConversionError, match="--model-yaml"):
        mcore_to_hf(bare, tmp_path / "out", progress=False)
    _nothing_left(tmp_path / "out")


# --- MoE / MLA families ---------------------------------------------------------------------------


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    hf = _copy(src, dst)
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


@pytest.mark.parametrize(
    "family,changes,match",
    [
        ("qwen3-moe", {"norm_topk_prob": False}, "norm_topk_prob=False is not supported for qwen3-moe"),
        ("qwen3-moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\].*only the first k layers may be dense"),
        ("deepseek-v3", {"rope_interleave": False}, "rope_interleave=False is not supported for deepseek-v3"),
        ("deepseek-v3", {"q_lora_rank": None}, "q_lora_rank=None is not supported for deepseek-v3: MLA without a query latent builds"),
        ("deepseek-v3", {"topk_group": 2}, "topk_group=2 .*num_experts_per_tok / topk_group must be 2"),
        ("deepseek-v3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}},
         "rope type 'dynamic' is not supported; allowed: yarn"),
        ("deepseek-v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 64, "truncate": False}},
         "yarn RoPE needs 'factor' and megatron's defaults for 'attention_factor'"),
    ],
    ids=["qwen3-moe-unnormalised-topk", "qwen3-moe-dense-layer-inside", "deepseek-no-rope-interleave", "deepseek-no-q-latent",
         "deepseek-group-ranking", "deepseek-dynamic-rope", "deepseek-yarn-untruncated"],
)  # fmt: skip
def test_unrepresentable_moe_or_mla_config(family, changes, match, converted, tmp_path):
    hf = _edit_config(converted(family).hf, tmp_path / "hf", **changes)
    with pytest.raises(ConversionError, match=match) as e:
        hf_to_mcore(hf, tmp_path / "out", progress=False)
    assert "config.json" in str(e.value)
    _nothing_left(tmp_path / "out")


def test_layers_beyond_the_configured_mtp_layers_are_refused(converted, tmp_path):
    """Tensors of a layer the config does not declare (an MTP layer under num_nextn_predict_layers=0)
    would be silently dropped: an error naming a tensor and the key to set."""
    import torch
    from safetensors.torch import load_file, save_file

    hf = _copy(converted("deepseek-v3").hf, tmp_path / "hf")
    shard = sorted(hf.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.2.eh_proj.weight"] = shard.name
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ConversionError, match=r"beyond num_hidden_layers=2 \+ num_nextn_predict_layers=0 \(e\.g\. "
        r"model\.layers\.2\.eh_proj\.weight\); if they are multi-token-prediction \(MTP\) layers, set"
    ):
        hf_to_mcore(hf, tmp_path / "out", progress=False)
    _nothing_left(tmp_path / "out")


def test_fused_expert_layout_is_refused(converted, tmp_path):
    """transformers 5 keeps experts fused in memory; save_pretrained(save_original_format=False)
    writes them so. Only the per-expert layout (save_pretrained's default, the Hub's) is read."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(converted("qwen3-moe").hf, dtype=torch.float32)
    model.save_pretrained(tmp_path / "hf", save_original_format=False)
    with pytest.raises(
        ConversionError,
        match=r"mlp\.experts\.(gate_up|down)_proj holds all experts fused.*save_original_format",
    ):
        hf_to_mcore(tmp_path / "hf", tmp_path / "out", progress=False)
    _nothing_left(tmp_path / "out")


def test_expert_parallel_layout_is_checked(converted, tmp_path):
    from loong_ckpt.cli import main

    assert (
        main(
            ["hf-to-mcore", str(converted("qwen3-moe").hf), str(tmp_path / "x"), "--ep", "3", "--no-progress"]
        )
        == 2
    )
    with pytest.raises(ConversionError, match=r"--ep=2 must divide the model's routed experts \(none\)"):
        hf_to_mcore(converted("llama").hf, tmp_path / "out", ep=2, progress=False)
    res = hf_to_mcore(converted("qwen3-moe").hf, tmp_path / "ok", ep=2, progress=False)
    assert "parallel.ep=2" in res.command
    assert json.loads((tmp_path / "ok" / "loong.json").read_text())["target_layout"] == {
        "tp": 1,
        "pp": 1,
        "ep": 2,
    }
    _nothing_left(tmp_path / "x")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_safetensors_fails_in_one_line_naming_the_file(converted, tmp_path, capsys, damage):
    from loong_ckpt.cli import main

    hf = _copy(converted("llama").hf, tmp_path / "hf")
    shard = hf / sorted(set(json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"].values()))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x93NUMPY not safetensors" * 40)
    assert main(["hf-to-mcore", str(hf), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {shard}: not a readable safetensors file") and "\n" not in err, err
    _nothing_left(tmp_path / "out")
