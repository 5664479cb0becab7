"""Offline conversion: logits parity with HF, round trip, CLI, layout recording."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loong_ckpt.testing import FAMILIES, MOE_FAMILIES, get_converted, logits_in_process
from loong_xpu.testing import launch_env

TOL = 1e-4


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """converted(family) -> Converted (shared by every module of the session)."""
    return lambda family: get_converted(tmp_path_factory, family)


def _hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_logits_match_hf_tp1(family, converted):
    c = converted(family)
    logits = logits_in_process(c.ckpt, c.tokens)
    assert logits.shape == c.ref.shape
    assert (logits - c.ref).abs().max().item() <= TOL


@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_online_hf_load_matches_hf_tp1(family, converted):
    c = converted(family)
    online = logits_in_process(c.hf, c.tokens)
    assert (online - c.ref).abs().max().item() <= TOL
    assert torch.equal(online, logits_in_process(c.ckpt, c.tokens))  # same weights as the offline path


@pytest.mark.parametrize("family", FAMILIES + MOE_FAMILIES)
def test_round_trip_is_bit_identical(family, converted, tmp_path):
    from loong_ckpt import mcore_to_hf

    c = converted(family)
    out = tmp_path / "hf"
    mcore_to_hf(c.ckpt, out, progress=False)
    a, b = _hf_tensors(c.hf), _hf_tensors(out)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert json.loads((out / "config.json").read_text()) == json.loads((c.hf / "config.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(b)

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(torch.load(c.tokens)).logits, c.ref)


def test_generated_config_loads_in_transformers(converted, tmp_path):
    """Without the source config.json (a checkpoint trained in Loong), config.json is generated
    from the foundation config; transformers must read the same architecture back."""
    import transformers

    from loong_ckpt import mcore_to_hf

    c = converted("llama")
    ckpt = _without_hf_config(c.ckpt, tmp_path / "ckpt")
    mcore_to_hf(ckpt, tmp_path / "hf", progress=False, max_shard_bytes=100_000)
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    src = transformers.AutoConfig.from_pretrained(c.hf)
    got = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "tie_word_embeddings"):  # fmt: skip
        assert getattr(got, key) == getattr(src, key), key
    assert got.rope_parameters["rope_theta"] == src.rope_parameters["rope_theta"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(torch.load(c.tokens)).logits, c.ref)


@pytest.mark.parametrize(
    "family,variant", [("qwen3-moe", {"mlp_only_layers": [0]})], ids=["qwen3-moe-dense-first-layer"]
)
def test_moe_variants_match_hf(family, variant, tmp_path):
    """Qwen3-MoE with a dense first layer (mlp_only_layers): offline and online logits equal HF's."""
    from loong_ckpt import hf_to_mcore
    from loong_ckpt.testing.hf_models import hf_logits, make_hf_model

    hf = make_hf_model(tmp_path / "hf", family, **variant)
    hf_to_mcore(hf, tmp_path / "ckpt", progress=False)
    tokens = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    ref = hf_logits(hf, tokens)
    for source in (tmp_path / "ckpt", hf):
        assert (logits_in_process(source, tmp_path / "tokens.pt") - ref).abs().max().item() <= TOL, source


def _without_hf_config(src: Path, ckpt: Path) -> Path:
    """A copy of checkpoint ``src`` whose loong.json records no source HF config.json."""
    shutil.copytree(src, ckpt)  # configs/ too: loong.json's hashes list every file
    meta = json.loads((src / "loong.json").read_text())
    del meta["hf_config"]
    (ckpt / "loong.json").write_text(json.dumps(meta))
    return ckpt


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_generated_config_loads_in_transformers(family, converted, tmp_path):
    """A MoE checkpoint without the source config.json gets a generated one: transformers builds
    the same architecture from it and the exported weights give the same logits."""
    import transformers

    from loong_ckpt import mcore_to_hf

    c = converted(family)
    mcore_to_hf(_without_hf_config(c.ckpt, tmp_path / "ckpt"), tmp_path / "hf", progress=False)
    src = transformers.AutoConfig.from_pretrained(c.hf)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    got = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert cfg != json.loads((c.hf / "config.json").read_text())  # generated, not copied
    keys = [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "rms_norm_eps",
    ]
    keys += {"qwen3-moe": ["num_experts", "num_key_value_heads", "head_dim", "mlp_only_layers", "decoder_sparse_step"],
             "deepseek-v3": ["n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
                             "routed_scaling_factor", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                             "qk_rope_head_dim", "v_head_dim", "rope_interleave"]}[family]  # fmt: skip
    for key in keys:
        assert getattr(got, key) == getattr(src, key), key
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(torch.load(c.tokens)).logits, c.ref)


def test_checkpoint_with_the_other_specs_names_loads(converted, tmp_path):
    """A deepseek-v3 checkpoint whose norms carry the other layer spec's names (TE's
    linear_q_up_proj.layer_norm_weight ... for the local q_layernorm.weight ...): training's
    load_checkpoint and mcore-to-hf both find them through the mapping's aliases."""
    from loong_ckpt import mcore_to_hf
    from loong_ckpt.families import key_aliases
    from loong_ckpt.integrity import hash_files, listed_files
    from loong_ckpt.mapping import layer_key, rule_key
    from loong_ckpt.mcore_io import Chunk, read_metadata, read_regions, write_checkpoint

    c = converted("deepseek-v3")
    stored = {k: (tuple(v.size), v.properties.dtype) for k, v in read_metadata(c.ckpt).items()}
    aliases, renamed = key_aliases(), {}
    for key in stored:
        name, layer = rule_key(key)
        other = aliases.get(name, (None,))[0]
        renamed[key] = key if other is None else other if layer is None else layer_key(other, layer)
    assert sum(a != b for a, b in renamed.items()) == 6  # q / kv latent norms and the pre-MLP norm, 2 layers
    back = {new: old for old, new in renamed.items()}
    chunks = [Chunk(renamed[k], shape, (0,) * len(shape), shape, dt) for k, (shape, dt) in stored.items()]

    def compute(chunk: Chunk) -> torch.Tensor:
        old = back[chunk.key]
        buf = torch.empty(*chunk.sizes, dtype=chunk.dtype)
        read_regions(c.ckpt, {old: ((0,) * len(chunk.sizes), buf)})
        return buf

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    write_checkpoint(ckpt, chunks, [], compute)
    meta = json.loads((c.ckpt / "loong.json").read_text())
    meta["files"] = hash_files(ckpt, listed_files(ckpt, "loong.json"))  # the renamed shards' own hashes
    (ckpt / "loong.json").write_text(json.dumps(meta))
    assert (logits_in_process(ckpt, c.tokens) - c.ref).abs().max().item() <= TOL
    mcore_to_hf(ckpt, tmp_path / "hf", progress=False)
    a, b = _hf_tensors(c.hf), _hf_tensors(tmp_path / "hf")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_metadata_and_yaml(converted):
    c = converted("qwen3")
    meta = json.loads((c.ckpt / "loong.json").read_text())
    assert meta["foundation"]["family"] == "qwen3" and meta["foundation"]["tie_word_embeddings"] is True
    assert meta["target_layout"] == {"tp": 1, "pp": 1}
    assert (c.ckpt / "metadata.json").is_file()
    name = meta["model_name"]
    assert (c.ckpt / "configs" / "model" / f"{name}.yaml").is_file()
    found = (c.ckpt / "configs" / "model" / "foundation" / f"{name}.yaml").read_text()
    assert "family: qwen3" in found and "kv_channels: 16" in found


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_model_yaml_is_the_checkpoint_model(family, converted):
    """The foundation YAML written next to a MoE / MLA checkpoint passes the model schema and
    describes the checkpoint's model (moe: and mla: sub-configs included), so `train` can use it."""
    from omegaconf import OmegaConf

    from loong_ckpt.hf_config import foundation_from_dict
    from loong_models import to_model_config

    c = converted(family)
    meta = json.loads((c.ckpt / "loong.json").read_text())
    yaml = c.ckpt / "configs" / "model" / "foundation" / f"{meta['model_name']}.yaml"
    model = to_model_config(OmegaConf.create({"foundation": OmegaConf.load(yaml)}))
    assert model.foundation == foundation_from_dict(meta["foundation"])
    assert model.foundation.moe is not None and (model.foundation.mla is not None) == (
        family == "deepseek-v3"
    )


def test_megatron_reads_same_keys_as_training_checkpoints(converted):
    """The converted checkpoint holds exactly the tensor keys the model's sharded_state_dict names."""
    from loong_ckpt.hf_config import foundation_from_dict
    from loong_ckpt.mcore_io import model_template, read_metadata

    c = converted("qwen2")
    cfg = foundation_from_dict(json.loads((c.ckpt / "loong.json").read_text())["foundation"])
    stored = read_metadata(c.ckpt)
    template = model_template(cfg)
    assert set(stored) == set(template.tensors)
    assert {k: tuple(v.size) for k, v in stored.items()} == template.tensors


def test_cli_round_trip_with_layout(converted, tmp_path, capsys):
    from loong_ckpt.cli import main

    c = converted("llama")
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    assert (
        main(
            [
                "hf-to-mcore",
                str(c.hf),
                str(ckpt),
                "--tp",
                "2",
                "--pp",
                "2",
                "--no-progress",
                "--name",
                "tiny-llama",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"model=tiny-llama train.init_from={ckpt}" in out and "parallel.tp=2 parallel.pp=2" in out
    assert json.loads((ckpt / "loong.json").read_text())["target_layout"] == {"tp": 2, "pp": 2}
    assert main(["mcore-to-hf", str(ckpt), str(hf), "--no-progress"]) == 0
    a, b = _hf_tensors(c.hf), _hf_tensors(hf)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert main(["hf-to-mcore", str(c.hf), str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert "output directory" in err and "--force" in err
    assert main(["hf-to-mcore", str(c.hf), str(tmp_path / "x"), "--tp", "3"]) == 2
    assert "--tp=3" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_cli_entry_point():
    """The console script is installed and answers without importing megatron first."""
    p = subprocess.run(["loong-convert", "--help"], capture_output=True, text=True, env=launch_env())
    assert p.returncode == 0 and "hf-to-mcore" in p.stdout and "mcore-to-hf" in p.stdout


def test_bf16_output(converted, tmp_path):
    from loong_ckpt import hf_to_mcore, mcore_to_hf

    c = converted("llama")
    hf_to_mcore(c.hf, tmp_path / "ckpt", dtype="bf16", progress=False)
    mcore_to_hf(tmp_path / "ckpt", tmp_path / "hf", progress=False)
    a, b = _hf_tensors(c.hf), _hf_tensors(tmp_path / "hf")
    for k in a:
        assert b[k].dtype == torch.bfloat16 and torch.equal(b[k], a[k].to(torch.bfloat16)), k


def test_moe_bf16_keeps_the_expert_bias_fp32(converted, tmp_path):
    """Megatron keeps the router's expert bias in fp32 (it accumulates tiny updates): a bf16
    conversion stores it fp32 and exports it fp32; everything else is bf16."""
    from loong_ckpt import hf_to_mcore, mcore_to_hf
    from loong_ckpt.mcore_io import read_metadata

    c = converted("deepseek-v3")
    hf_to_mcore(c.hf, tmp_path / "ckpt", dtype="bf16", progress=False)
    dtypes = {k: v.properties.dtype for k, v in read_metadata(tmp_path / "ckpt").items()}
    assert dtypes["decoder.layers.1.mlp.router.expert_bias"] == torch.float32
    assert dtypes["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"] == torch.bfloat16
    mcore_to_hf(tmp_path / "ckpt", tmp_path / "hf", progress=False)
    a, b = _hf_tensors(c.hf), _hf_tensors(tmp_path / "hf")
    for k in a:
        want = torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16
        assert b[k].dtype == want and torch.equal(b[k], a[k].to(want)), k
