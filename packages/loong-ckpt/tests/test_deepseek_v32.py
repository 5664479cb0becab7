"""DeepSeek-V3.2 (MLA + DeepSeek sparse attention with its lightning indexer) against HF's
DeepseekV32ForCausalLM: logits parity with the indexer's top-k dropping keys (offline and online
load), the bit-identical round trip, the generated config.json, and the settings refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loong_ckpt.hf_config import ConversionError
from loong_ckpt.testing import logits_in_process
from loong_ckpt.testing.hf_models import hf_logits, make_hf_model

TOL = 1e-4  # the family tolerance of test_convert
SEQ = 24  # tokens per sequence; the tiny model's index_topk is 8, so queries past 8 drop keys


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    """The tiny HF DeepSeek-V3.2 (a dense layer, then MoE), its Loong checkpoint, tokens and HF logits."""
    from loong_ckpt import hf_to_mcore

    base = tmp_path_factory.mktemp("deepseek-v32")
    hf = make_hf_model(base / "hf", "deepseek-v32", max_shard_size="200KB")
    hf_to_mcore(hf, base / "ckpt", progress=False)
    tokens = torch.randint(0, 1000, (2, SEQ), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, base / "tokens.pt")
    return {
        "base": base,
        "hf": hf,
        "ckpt": base / "ckpt",
        "tokens": base / "tokens.pt",
        "ref": hf_logits(hf, tokens),
    }


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_the_tiny_model_has_an_indexer_whose_top_k_drops_keys_that_matter(v32, tmp_path):
    """Guards the parity test below: the indexer's tensors are in the checkpoint, and HF's logits
    with the indexer keeping every key (index_topk = SEQ, same weights) differ from the sparse ones."""
    names = _tensors(v32["hf"])
    for part in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
        assert f"model.layers.1.self_attn.indexer.{part}" in names
    config = json.loads((v32["hf"] / "config.json").read_text())
    assert config["index_topk"] < SEQ
    dense = make_hf_model(tmp_path / "dense", "deepseek-v32", index_topk=SEQ)
    assert torch.equal(
        _tensors(dense)["model.layers.0.self_attn.indexer.wk.weight"],
        names["model.layers.0.self_attn.indexer.wk.weight"],
    )
    assert (hf_logits(dense, torch.load(v32["tokens"])) - v32["ref"]).abs().max().item() > 1e-2


def test_logits_match_hf_after_conversion_and_after_online_load(v32):
    offline = logits_in_process(v32["ckpt"], v32["tokens"])
    assert offline.shape == v32["ref"].shape
    assert (offline - v32["ref"]).abs().max().item() <= TOL
    online = logits_in_process(v32["hf"], v32["tokens"])
    assert torch.equal(online, offline)  # the same weights either way


def test_round_trip_is_bit_identical(v32, tmp_path):
    import transformers

    from loong_ckpt import mcore_to_hf

    mcore_to_hf(v32["ckpt"], tmp_path / "hf", progress=False)
    a, b = _tensors(v32["hf"]), _tensors(tmp_path / "hf")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (v32["hf"] / "config.json").read_text()
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(torch.load(v32["tokens"])).logits, v32["ref"])


def test_a_generated_config_json_builds_the_same_model_in_transformers(v32, tmp_path):
    """Without the source config.json (a checkpoint trained in Loong) config.json is generated:
    transformers reads the same indexer and MoE back, and the exported weights give HF's logits."""
    import transformers

    from loong_ckpt import mcore_to_hf

    ckpt = tmp_path / "ckpt"
    shutil.copytree(v32["ckpt"], ckpt)
    meta = json.loads((ckpt / "loong.json").read_text())
    del meta["hf_config"]
    (ckpt / "loong.json").write_text(json.dumps(meta))
    mcore_to_hf(ckpt, tmp_path / "hf", progress=False)
    generated = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert generated != json.loads((v32["hf"] / "config.json").read_text())  # generated, not copied
    src, got = (
        transformers.AutoConfig.from_pretrained(v32["hf"]),
        transformers.AutoConfig.from_pretrained(tmp_path / "hf"),
    )
    for key in ("index_n_heads", "index_head_dim", "index_topk", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                "n_routed_experts", "first_k_dense_replace", "mlp_layer_types", "n_group", "topk_group"):  # fmt: skip
        assert getattr(got, key) == getattr(src, key), key
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(torch.load(v32["tokens"])).logits, v32["ref"])


def test_an_all_dense_deepseek_v32_reads_as_no_moe_and_writes_back_as_all_dense_layers():
    from loong_ckpt.hf_config import from_hf_config, to_hf_config

    hf = {"architectures": ["DeepseekV32ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 1000, "q_lora_rank": 32,
          "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
          "first_k_dense_replace": 2, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8}  # fmt: skip
    cfg = from_hf_config(hf)
    assert cfg.moe is None and cfg.sparse_attention.index_topk == 8
    out = to_hf_config(cfg, torch.float32)
    assert out["first_k_dense_replace"] == 2 and "rope_interleave" not in out
    assert from_hf_config(out) == cfg


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05 is not supported for deepseek-v32: HF's indexer LayerNorm has eps 1e-06"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}},
         "rope_parameters=.* is not supported for deepseek-v32: RoPE scaling"),
        ({"mlp_layer_types": ["sparse", "dense"]}, r"mlp_layer_types=\['sparse', 'dense'\] .*only the first k layers may be dense"),
    ],
    ids=["indexer-norm-eps", "yarn", "dense-after-moe"],
)  # fmt: skip
def test_settings_loong_cannot_represent_are_refused_naming_the_key(v32, changes, match, tmp_path):
    from loong_ckpt import hf_to_mcore

    hf = shutil.copytree(v32["hf"], tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ConversionError, match=match) as e:
        hf_to_mcore(hf, tmp_path / "out", progress=False)
    assert "config.json" in str(e.value)


@pytest.mark.dist
def test_logits_match_hf_at_tp2_and_ep2(v32, tmp_path):
    """One torchrun launch, 2 processes, gloo: at TP=2 (attention heads split, the indexer
    replicated, sequence parallel as megatron's absorbed MLA requires; an all-dense DeepSeek-V3.2)
    and at EP=2 (the MoE model), from the checkpoint and the HF directory loaded online."""
    from loong_ckpt import hf_to_mcore
    from loong_ckpt.testing import run_layouts

    dense = make_hf_model(tmp_path / "dense-hf", "deepseek-v32", first_k_dense_replace=2)
    hf_to_mcore(dense, tmp_path / "dense-ckpt", progress=False)
    refs = {2: hf_logits(dense, torch.load(v32["tokens"])), 1: v32["ref"]}  # by TP size
    sources = {2: (tmp_path / "dense-ckpt", dense), 1: (v32["ckpt"], v32["hf"])}
    jobs = [dict(source=str(src), tokens=str(v32["tokens"]), out=str(tmp_path / f"tp{tp}-{i}.pt"), tp=tp, pp=1, ep=2 // tp)
            for tp in (2, 1) for i, src in enumerate(sources[tp])]  # fmt: skip
    for job, logits in zip(jobs, run_layouts(jobs)):
        diff = (logits - refs[job["tp"]]).abs().max().item()
        assert diff <= TOL, f"{job['source']} at tp={job['tp']} ep={job['ep']}: max abs diff {diff}"
