"""diffusers WanTransformer3DModel <-> Loong Wan: tiny random diffusers models (T2V, and I2V with
CLIP image tokens) give the same velocity in Loong (fp32, CPU) loaded online and from the converted
checkpoint, also with per-token timesteps (Wan2.2 TI2V) and at TP=2 with and without sequence
parallelism (torchrun, gloo); diffusers ->
Megatron -> diffusers is bit-identical; the CLI converts both ways; bad input fails naming it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

diffusers = pytest.importorskip("diffusers")

from loong_ckpt import cli  # noqa: E402
from loong_ckpt.diffusion import (  # noqa: E402
    diffusers_to_mcore,
    load_diffusers_weights,
    mcore_to_diffusers,
    wan_from_diffusers,
)
from loong_ckpt.hf_config import ConversionError  # noqa: E402
from loong_ckpt.training import load_checkpoint  # noqa: E402
from loong_models import ModelConfig, build_model, build_transformer_config  # noqa: E402
from loong_xpu import get_accelerator  # noqa: E402
from loong_xpu.testing import megatron_world  # noqa: E402

TOL = 1e-4
HERE = Path(__file__).parent
TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=24, in_channels=4, out_channels=4,
            text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, rope_max_seq_len=64)  # fmt: skip
I2V = dict(TINY, image_dim=20, added_kv_proj_dim=48)


def _make(root: Path, kw: dict, text_len: int, seed: int) -> dict:
    """A random diffusers model (weights perturbed off their init) saved under root/hf, inputs and
    its output, and the converted checkpoint root/ckpt."""
    torch.manual_seed(seed)
    ref = diffusers.WanTransformer3DModel(**kw).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(root / "hf")
    x = dict(latents=torch.randn(2, 4, 3, 8, 12), timestep=torch.tensor([100.0, 800.0]),
             context=torch.randn(2, text_len, 32), image=torch.randn(2, 5, 20) if "image_dim" in kw else None)  # fmt: skip
    with torch.no_grad():
        x["want"] = ref(x["latents"], x["timestep"], x["context"], encoder_hidden_states_image=x["image"],
                        return_dict=False)[0]  # fmt: skip
        # Wan2.2 TI2V: one timestep per latent token (3 x 4 x 6 patches)
        x["timestep_tokens"] = torch.randint(0, 1000, (2, 72)).float()
        x["want_tokens"] = ref(x["latents"], x["timestep_tokens"], x["context"],
                               encoder_hidden_states_image=x["image"], return_dict=False)[0]  # fmt: skip
    diffusers_to_mcore(root / "hf", root / "ckpt", progress=False)
    return x


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # diffusers' I2V attention takes the text as the last 512 context tokens
    return {name: (tmp_path_factory.mktemp(name), kw, n) for name, kw, n in (("t2v", TINY, 7), ("i2v", I2V, 512))}


@pytest.fixture(scope="module")
def made(models):
    return {name: _make(root, kw, n, seed) for seed, (name, (root, kw, n)) in enumerate(models.items())}


def _loong(root: Path, how: str):
    cfg = ModelConfig(diffusion=wan_from_diffusers(json.loads((root / "hf/config.json").read_text()), "cfg"),
                      layer_backend="local")  # fmt: skip
    base = build_transformer_config(cfg.foundation, use_cpu_initialization=True, params_dtype=torch.float32)
    model = build_model(cfg, base, device_type="cpu").eval()
    if how == "online":
        assert load_diffusers_weights(root / "hf", [model], cfg.diffusion) == len(list(model.parameters()))
    else:
        load_checkpoint(root / "ckpt", [model])
    return model


@pytest.mark.parametrize("name", ["t2v", "i2v"])
@pytest.mark.parametrize("how", ["online", "ckpt"])
def test_loong_wan_gives_the_diffusers_velocity(name, how, models, made):
    x = made[name]
    with megatron_world(get_accelerator("cpu")), torch.no_grad():
        model = _loong(models[name][0], how)
        assert sum(p.numel() for p in model.parameters()) == model.cfg.num_parameters()
        got = model(x["latents"], x["timestep"], x["context"], x["image"])
        per_token = model(x["latents"], x["timestep_tokens"], x["context"], x["image"])
    assert got.shape == x["want"].shape
    assert (got - x["want"]).abs().max().item() <= TOL
    assert (per_token - x["want_tokens"]).abs().max().item() <= TOL


@pytest.mark.parametrize("name", ["t2v", "i2v"])
def test_diffusers_to_megatron_to_diffusers_is_bit_identical(name, models, made, tmp_path):
    root = models[name][0]
    meta = json.loads((root / "ckpt/loong.json").read_text())
    mcore_to_diffusers(root / "ckpt", tmp_path / "back", meta)
    a = load_file(root / "hf/diffusion_pytorch_model.safetensors")
    b = {k: v for f in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "back/config.json").read_text()) == json.loads((root / "hf/config.json").read_text())
    again = diffusers.WanTransformer3DModel.from_config(json.loads((tmp_path / "back/config.json").read_text()))
    again.load_state_dict(b, strict=True)


def test_loong_convert_cli_converts_wan_both_ways(models, made, tmp_path, capsys):
    root = models["t2v"][0]
    assert cli.main(["hf-to-mcore", str(root / "hf"), str(tmp_path / "ck"), "--no-progress"]) == 0
    assert cli.main(["mcore-to-hf", str(tmp_path / "ck"), str(tmp_path / "back"), "--dtype", "bf16", "--no-progress"]) == 0
    b = load_file(next((tmp_path / "back").glob("*.safetensors")))
    a = load_file(root / "hf/diffusion_pytorch_model.safetensors")
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(b[k], a[k].bfloat16()) for k in a)
    assert cli.main(["mcore-to-hf", str(tmp_path / "ck"), str(tmp_path / "wan"), "--wan-layout", "wan", "--no-progress"]) == 0
    w = _weights(tmp_path / "wan")
    assert torch.equal(w["blocks.0.self_attn.q.weight"], a["blocks.0.attn1.to_q.weight"])


def test_bad_wan_configs_fail_naming_the_key(models, made, tmp_path):
    cfg = json.loads((models["t2v"][0] / "hf/config.json").read_text())
    with pytest.raises(ConversionError, match="qk_norm"):
        wan_from_diffusers({**cfg, "qk_norm": "rms_norm"}, "x/config.json")
    with pytest.raises(ConversionError, match="attention_head_dim=9"):
        wan_from_diffusers({**cfg, "attention_head_dim": 9}, "x/config.json")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "ffn_dim": 96}))
    os.link(models["t2v"][0] / "hf/diffusion_pytorch_model.safetensors", bad / "diffusion_pytorch_model.safetensors")
    with pytest.raises(ConversionError, match=r"does not match the weights: blocks\.0\.ffn\.net\.0\.proj\.weight"):
        diffusers_to_mcore(bad, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.dist
def test_tp2_and_sequence_parallel_loong_wan_give_the_diffusers_velocity(models, made, tmp_path):
    root, x = models["t2v"][0], made["t2v"]
    torch.save({k: x[k] for k in ("latents", "timestep", "context", "timestep_tokens")}, tmp_path / "in.pt")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HERE / "wan_worker.py"),
           str(root / "hf"), str(root / "ckpt"), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")]  # fmt: skip
    proc = subprocess.run(cmd, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(tmp_path / "out.pt")
    assert sorted(got) == ["ckpt", "hf-online", "sp", "sp-tokens"]  # sp: sequence parallel (online)
    for kind, out in got.items():
        want = x["want_tokens"] if kind == "sp-tokens" else x["want"]
        assert (out - want).abs().max().item() <= TOL, kind


def test_init_from_refuses_a_diffusers_directory_for_another_model_and_an_hf_one_for_wan(models, made, tmp_path):
    from safetensors.torch import save_file

    from loong_ckpt.restore import RestoreError, load_weights

    hf = models["t2v"][0] / "hf"
    with pytest.raises(RestoreError, match="is a Wan transformer directory .diffusers or Wan-AI layout., but the model has no model.diffusion"):
        load_weights(str(hf), [], ModelConfig())
    llm = tmp_path / "llm"
    llm.mkdir()
    (llm / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"x": torch.zeros(1)}, llm / "model.safetensors")
    wan = ModelConfig(diffusion=wan_from_diffusers(json.loads((hf / "config.json").read_text()), "cfg"))
    with pytest.raises(RestoreError, match="an HF model directory, but model.diffusion"):
        load_weights(str(llm), [], wan)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("name", ["t2v", "i2v"])
def test_wan_release_layout_converts_both_ways_and_diffusers_reads_it(name, models, made, tmp_path):
    """Loong -> the Wan-AI release layout (blocks.N.self_attn.q, head.head, ...): diffusers' own
    converter (convert_wan_transformer_to_diffusers) turns it into the original diffusers weights
    exactly; the release directory loads into Loong online with the diffusers velocity, converts
    offline, and exports back bit-identically."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    from loong_ckpt.diffusion import wan_from_release

    root, x = models[name][0], made[name]
    meta = json.loads((root / "ckpt/loong.json").read_text())
    mcore_to_diffusers(root / "ckpt", tmp_path / "wan", meta, layout="wan")
    release = _weights(tmp_path / "wan")
    config = json.loads((tmp_path / "wan/config.json").read_text())
    assert config["_class_name"] == "WanModel" and config["model_type"] == name
    assert {"blocks.1.self_attn.q.weight", "blocks.1.cross_attn.o.bias", "blocks.0.norm3.weight", "head.head.weight",
            "head.modulation", "blocks.0.modulation", "time_embedding.0.weight", "time_projection.1.bias",
            "text_embedding.2.weight", "patch_embedding.weight"} <= set(release)  # fmt: skip
    original = load_file(root / "hf/diffusion_pytorch_model.safetensors")
    by_diffusers = convert_wan_transformer_to_diffusers(dict(release))
    assert set(by_diffusers) == set(original) and all(torch.equal(by_diffusers[k], original[k]) for k in original)

    cfg = wan_from_release(config, "config.json", 20 if name == "i2v" else None)
    # the release has no rope_max_seq_len (Wan's RoPE table is 1024 long; Loong computes it per grid)
    want_cfg = wan_from_diffusers(json.loads((root / "hf/config.json").read_text()), "cfg")
    assert dataclasses.replace(cfg, rope_max_seq_len=want_cfg.rope_max_seq_len) == want_cfg
    with megatron_world(get_accelerator("cpu")), torch.no_grad():
        base = build_transformer_config(ModelConfig().foundation, use_cpu_initialization=True, params_dtype=torch.float32)
        model = build_model(ModelConfig(diffusion=cfg, layer_backend="local"), base, device_type="cpu").eval()
        load_diffusers_weights(tmp_path / "wan", [model], cfg)
        got = model(x["latents"], x["timestep"], x["context"], x["image"])
    assert (got - x["want"]).abs().max().item() <= TOL
    diffusers_to_mcore(tmp_path / "wan", tmp_path / "ckpt", progress=False)
    mcore_to_diffusers(tmp_path / "ckpt", tmp_path / "back", json.loads((tmp_path / "ckpt/loong.json").read_text()))
    back = _weights(tmp_path / "back")
    assert set(back) == set(release) and all(torch.equal(back[k], release[k]) for k in release)
    assert json.loads((tmp_path / "back/config.json").read_text()) == config
