"""Qwen2.5-VL through the composed mapping: a tiny random HF ``Qwen2_5_VLForConditionalGeneration``
converts to Loong's OmniCombinationModel and back; logits match HF on a real image + text (fp32);
HF -> Megatron -> HF is bit-identical; online load / export; bad input gives clear errors."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loong_ckpt import ConversionError, hf_to_mcore, mcore_to_hf
from loong_ckpt.testing import DictReader, get_converted_vlm, logits_in_process, run_layouts
from loong_ckpt.testing.hf_models import VLM_TOKENS, hf_vlm_logits, make_hf_vlm

TOL = 1e-4


@pytest.fixture(scope="session")
def vlm(tmp_path_factory):
    return get_converted_vlm(tmp_path_factory)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_packed_qkv_layout_is_megatrons():
    """HF's packed [q; k; v] (each all heads) -> per head its q, k, v (megatron, groups = heads)."""
    from loong_ckpt.vlm import PACKED_QKV, AttentionShapes

    c = AttentionShapes(num_layers=1, num_attention_heads=4, head_dim=3)
    rows = torch.arange(3 * 12).float()[:, None].expand(-1, 5)  # row i holds i
    fused = PACKED_QKV.fuse([rows], c, 4)
    head1 = fused[9:18, 0].tolist()  # q rows 3..5, k rows 12+3.., v rows 24+3..
    assert head1 == [3, 4, 5, 15, 16, 17, 27, 28, 29]
    assert torch.equal(PACKED_QKV.unfuse(fused, c, 4)[0], rows)


@pytest.mark.parametrize("tp", [1, 2])
def test_vision_tp_shards_assemble_the_global_tensor(tp):
    """Every rank's online shard of each ViT / merger rule, concatenated along the split dim, is
    the global tensor the offline converter writes (what megatron checkpoints hold)."""
    from loong_ckpt.mapping import GATE_UP, Split
    from loong_ckpt.vlm import QWEN25_MERGER, QWEN25_VIT, AttentionShapes, PaddedFfnRule

    h, f, m = 32, 40, 128  # the MLP padded to 64 units (32 per rank at TP=2: rank 1 holds 8 real)
    c = AttentionShapes(
        num_layers=2, num_attention_heads=4, head_dim=8, ffn_hidden_size=f, padded_ffn_hidden_size=64
    )
    shapes = {
        "patch_embed.proj.weight": [(h, 3, 2, 14, 14)], "blocks.0.norm1.weight": [(h,)],
        "blocks.0.attn.qkv.weight": [(3 * h, h)], "blocks.0.attn.qkv.bias": [(3 * h,)],
        "blocks.0.attn.proj.weight": [(h, h)], "blocks.0.attn.proj.bias": [(h,)], "blocks.0.norm2.weight": [(h,)],
        "blocks.0.mlp.gate_proj.weight": [(f, h)], "blocks.0.mlp.gate_proj.bias": [(f,)],
        "blocks.0.mlp.down_proj.weight": [(h, f)], "blocks.0.mlp.down_proj.bias": [(h,)],
        "merger.ln_q.weight": [(h,)], "merger.mlp.0.weight": [(m, m)], "merger.mlp.0.bias": [(m,)],
        "merger.mlp.2.weight": [(64, m)], "merger.mlp.2.bias": [(64,)],
    }  # fmt: skip
    torch.manual_seed(0)
    for rule in QWEN25_VIT + QWEN25_MERGER:
        names = rule.hf_names(0)
        shape = shapes.get(names[0]) or shapes[names[0].replace("up_proj", "gate_proj")]
        hf = {n: torch.randn(shape[0]) for n in names}
        whole = rule.to_mcore(list(hf.values()), c, 0)
        if isinstance(rule, PaddedFfnRule):
            assert whole.shape[rule.split.dim] == (128 if rule.transform is GATE_UP else 64), rule.mcore
        shards = [rule.tp_shard(DictReader(hf), 0, c, r, tp, 0) for r in range(tp)]
        if rule.split is Split.REPLICATED:
            assert all(torch.equal(s, whole) for s in shards), rule.mcore
        elif rule.transform is GATE_UP:
            assert torch.equal(
                torch.cat([s.chunk(2)[0] for s in shards] + [s.chunk(2)[1] for s in shards]), whole
            )
        else:
            assert torch.equal(torch.cat(shards, dim=rule.split.dim), whole), rule.mcore
        assert all(torch.equal(a, b) for a, b in zip(rule.to_hf(whole, c), hf.values())), rule.mcore


def test_hf_names_are_what_transformers_writes(vlm):
    """The installed transformers writes the Hub naming (visual.*, model.layers.*), which the
    mapping reads; the vision tower's and merger's tensors are all converted."""
    names = set(_tensors(vlm.hf))
    assert "visual.blocks.0.attn.qkv.weight" in names and "model.layers.0.self_attn.q_proj.weight" in names
    assert "visual.merger.mlp.0.weight" in names and "lm_head.weight" in names
    meta = json.loads((vlm.ckpt / "loong.json").read_text())
    assert meta["hf_naming"] == "hub"
    assert meta["model"]["image_encoder"]["type"] == "qwen2.5-vit"
    assert meta["foundation"]["mrope_section"] == [2, 3, 3]


def test_flat_hub_config_maps_like_the_nested_one(vlm):
    """Hub configs written by transformers 4.x keep the LLM's fields at the top level (mrope as
    rope_scaling type "mrope", in_chans in the vision config): the same Loong model."""
    from loong_ckpt.components import model_from_hf

    nested = json.loads((vlm.hf / "config.json").read_text())
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    flat.update(
        text, rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}
    )
    flat["vision_config"] = {
        k: v for k, v in nested["vision_config"].items() if k not in ("in_channels", "rope_parameters")
    }
    flat["vision_config"]["in_chans"] = 3
    assert model_from_hf(flat) == model_from_hf(nested)


def test_logits_match_hf_tp1(vlm):
    inputs = torch.load(vlm.tokens)
    assert int((inputs["input_ids"] == VLM_TOKENS["image_token_id"]).sum()) > 8  # the image is really in it
    logits = logits_in_process(vlm.ckpt, vlm.tokens)
    assert logits.shape == vlm.ref.shape
    assert (logits - vlm.ref).abs().max().item() <= TOL


def test_online_hf_load_matches_hf_tp1(vlm):
    online = logits_in_process(vlm.hf, vlm.tokens)
    assert (online - vlm.ref).abs().max().item() <= TOL
    assert torch.equal(online, logits_in_process(vlm.ckpt, vlm.tokens))


def test_round_trip_is_bit_identical(vlm, tmp_path):
    import transformers

    out = tmp_path / "hf"
    mcore_to_hf(vlm.ckpt, out, progress=False)
    _assert_same_tensors(_tensors(vlm.hf), _tensors(out))
    assert json.loads((out / "config.json").read_text()) == json.loads((vlm.hf / "config.json").read_text())
    assert isinstance(transformers.AutoConfig.from_pretrained(out), transformers.Qwen2_5_VLConfig)
    assert torch.equal(hf_vlm_logits(out, torch.load(vlm.tokens)), vlm.ref)


def test_tied_embeddings(vlm, tmp_path):
    """Qwen2.5-VL-3B ties its embeddings (top-level tie_word_embeddings): no lm_head on either side."""
    hf = make_hf_vlm(tmp_path / "hf", tie=True)
    assert "lm_head.weight" not in _tensors(hf)
    hf_to_mcore(hf, tmp_path / "ckpt", progress=False)
    meta = json.loads((tmp_path / "ckpt" / "loong.json").read_text())
    assert meta["foundation"]["tie_word_embeddings"] is True
    logits = logits_in_process(tmp_path / "ckpt", vlm.tokens)
    assert (logits - hf_vlm_logits(hf, torch.load(vlm.tokens))).abs().max().item() <= TOL
    mcore_to_hf(tmp_path / "ckpt", tmp_path / "back", progress=False)
    _assert_same_tensors(_tensors(hf), _tensors(tmp_path / "back"))
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads(
        (hf / "config.json").read_text()
    )


def test_generated_config_loads_in_transformers(vlm, tmp_path):
    """A checkpoint without the source config.json (trained in Loong) gets a generated one that
    transformers reads as the same Qwen2.5-VL."""
    import transformers

    ckpt = tmp_path / "ckpt"
    shutil.copytree(vlm.ckpt, ckpt)
    meta = json.loads((ckpt / "loong.json").read_text())
    del meta["hf_config"], meta["hf_naming"]
    (ckpt / "loong.json").write_text(json.dumps(meta))
    mcore_to_hf(ckpt, tmp_path / "hf", progress=False)
    src = transformers.AutoConfig.from_pretrained(vlm.hf)
    got = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert got.model_type == "qwen2_5_vl" and got.to_dict()["vision_config"] == src.to_dict()["vision_config"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rms_norm_eps"):  # fmt: skip
        assert getattr(got.text_config, key) == getattr(src.text_config, key), key
    assert got.text_config.rope_parameters["mrope_section"] == [2, 3, 3]
    for key in (*VLM_TOKENS, "tie_word_embeddings"):
        assert getattr(got, key) == getattr(src, key), key
    _assert_same_tensors(_tensors(vlm.hf), _tensors(tmp_path / "hf"))
    assert torch.equal(hf_vlm_logits(tmp_path / "hf", torch.load(vlm.tokens)), vlm.ref)


def test_module_naming_is_read_and_written_back(vlm, tmp_path):
    """transformers' module naming (model.visual.*, model.language_model.*) converts to the same
    checkpoint, and export writes that naming back; transformers loads either."""
    hf = tmp_path / "hf-modules"
    hf.mkdir()
    shutil.copy(vlm.hf / "config.json", hf / "config.json")
    renamed = {}
    for name, t in _tensors(vlm.hf).items():
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        renamed[name] = t
    save_file(renamed, hf / "model.safetensors", metadata={"format": "pt"})
    hf_to_mcore(hf, tmp_path / "ckpt", progress=False)
    assert json.loads((tmp_path / "ckpt" / "loong.json").read_text())["hf_naming"] == "modules"
    assert torch.equal(
        logits_in_process(tmp_path / "ckpt", vlm.tokens), logits_in_process(vlm.ckpt, vlm.tokens)
    )
    mcore_to_hf(tmp_path / "ckpt", tmp_path / "back", progress=False)
    _assert_same_tensors(renamed, _tensors(tmp_path / "back"))
    assert torch.equal(hf_vlm_logits(tmp_path / "back", torch.load(vlm.tokens)), vlm.ref)


def test_cli_round_trip_with_tp2_layout(vlm, tmp_path, capsys):
    from loong_ckpt.cli import main

    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    assert (
        main(["hf-to-mcore", str(vlm.hf), str(ckpt), "--tp", "2", "--no-progress", "--name", "tiny-qwen-vl"])
        == 0
    )
    assert "model=tiny-qwen-vl" in capsys.readouterr().out
    model_yaml = (ckpt / "configs" / "model" / "tiny-qwen-vl.yaml").read_text()
    assert "image_encoder: tiny-qwen-vl" in model_yaml and "image_token_id: 990" in model_yaml
    assert (ckpt / "configs" / "model" / "image_encoder" / "tiny-qwen-vl.yaml").is_file()
    assert main(["mcore-to-hf", str(ckpt), str(hf), "--no-progress"]) == 0
    _assert_same_tensors(_tensors(vlm.hf), _tensors(hf))
    # the ViT has 2 heads: a layout of 4 cannot hold it
    assert main(["hf-to-mcore", str(vlm.hf), str(tmp_path / "x"), "--tp", "4", "--no-progress"]) == 2
    assert "image encoder's attention heads (2)" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_converted_yaml_composes_into_the_same_model(vlm):
    """The written Hydra files compose (through loong_models' schema) into the converted model."""
    from hydra import compose, initialize_config_dir

    from loong_ckpt.components import config_from_meta, same_model
    from loong_models import to_model_config

    meta = json.loads((vlm.ckpt / "loong.json").read_text())
    with initialize_config_dir(config_dir=str(vlm.ckpt / "configs"), version_base=None):
        raw = compose(config_name=f"model/{meta['model_name']}")
    assert same_model(to_model_config(raw.model), config_from_meta(meta))


def test_training_checkpoint_exports_to_hf(vlm, tmp_path):
    """The train app's path: HF weights loaded online into the OmniCombinationModel, a training
    checkpoint saved by megatron (with what loong.json records of the model), exported to HF."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loong_ckpt.components import checkpoint_meta
    from loong_ckpt.mcore_io import _single_process_megatron
    from loong_ckpt.online import export_hf, load_hf_weights, read_hf_model
    from loong_ckpt.training import save_checkpoint
    from loong_models import build_model, build_transformer_config

    cfg = dataclasses.replace(read_hf_model(vlm.hf), layer_backend="local")
    with _single_process_megatron():
        model_parallel_cuda_manual_seed(0)
        tconfig = build_transformer_config(
            cfg.foundation, use_cpu_initialization=True, params_dtype=torch.float32
        )
        model = build_model(cfg, tconfig, device_type="cpu")
        tensors = [v for v in model.sharded_state_dict().values() if not isinstance(v, ShardedObject)]
        assert load_hf_weights(vlm.hf, [model], cfg) == len(tensors)  # every parameter of all components
        with torch.no_grad():  # "training" moved one vision tensor
            model.image_encoder.decoder.layers[1].self_attention.linear_qkv.bias.mul_(2)
        extra = {**checkpoint_meta(cfg), "hf_config": json.loads((vlm.hf / "config.json").read_text())}
        ckpt = save_checkpoint(tmp_path / "checkpoints", 1, [model], extra=extra)
        export_hf(ckpt, tmp_path / "hf")
    source, exported = _tensors(vlm.hf), _tensors(tmp_path / "hf")
    moved = "visual.blocks.1.attn.qkv.bias"
    assert torch.equal(exported[moved], 2 * source[moved])
    _assert_same_tensors(
        {k: v for k, v in source.items() if k != moved}, {k: v for k, v in exported.items() if k != moved}
    )


# --- bad input ----------------------------------------------------------------------------------


def _edit_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_missing_vision_tensor_names_the_key(vlm, tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(vlm.hf / "config.json", hf / "config.json")
    tensors = _tensors(vlm.hf)
    del tensors["visual.blocks.1.attn.qkv.bias"]
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"visual\.blocks\.1\.attn\.qkv\.bias \(for megatron key "
                                              r"image_encoder\.decoder\.layers\.self_attention\.linear_qkv\.bias\) is missing"):  # fmt: skip
        hf_to_mcore(hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_vision_config_that_does_not_match_the_weights(vlm, tmp_path):
    hf = _edit_config(vlm.hf, tmp_path / "hf", lambda c: c["vision_config"].update(intermediate_size=48))
    with pytest.raises(ConversionError, match="does not match the weights") as e:
        hf_to_mcore(hf, tmp_path / "out", progress=False)
    assert "visual.blocks.0.mlp.gate_proj.weight" in str(e.value) and "(40, 32)" in str(e.value)
    assert "(48, 32)" in str(e.value)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c["vision_config"].update(hidden_act="gelu_pytorch_tanh"),
         "vision_config.hidden_act='gelu_pytorch_tanh' is not supported for Qwen2.5-VL; allowed: 'silu'"),
        (lambda c: c["vision_config"].update(out_hidden_size=96),
         "vision_config.out_hidden_size=96 must equal the LLM's hidden_size=64"),
        (lambda c: c["vision_config"].update(window_size=50), "vision_config.window_size=50 must be a positive multiple"),
        (lambda c: c["text_config"]["rope_parameters"].pop("mrope_section"), "mrope_section=None; expected 3 integers"),
        (lambda c: c["vision_config"].pop("depth"), "vision_config.depth is missing"),
        (lambda c: c.update(architectures=["Qwen2VLForConditionalGeneration"], model_type="qwen2_vl"),
         r"unsupported architecture \['Qwen2VLForConditionalGeneration'\]; supported: .*Qwen2_5_VLForConditionalGeneration"),
    ],
    ids=["vision-act", "out-hidden", "window", "no-mrope", "no-depth", "qwen2-vl"],
)  # fmt: skip
def test_unsupported_vision_variants(vlm, tmp_path, edit, message):
    hf = _edit_config(vlm.hf, tmp_path / "hf", edit)
    with pytest.raises(ConversionError, match=message):
        hf_to_mcore(hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_encoder_without_hf_mapping(vlm, tmp_path):
    """A VLM whose image encoder type has no HF mapping (SigLIP today) cannot be exported."""
    from loong_ckpt.online import read_hf_model
    from loong_models import ImageEncoderConfig

    cfg = read_hf_model(vlm.hf)
    siglip = dataclasses.replace(cfg, image_encoder=ImageEncoderConfig(type="siglip", temporal_patch_size=1))
    with pytest.raises(ConversionError, match="no HF mapping is declared for model.image_encoder.type='siglip'; "
                                              "types with one: qwen2.5-vit"):  # fmt: skip
        mcore_to_hf(vlm.ckpt, tmp_path / "hf", foundation=siglip, progress=False)
    assert not (tmp_path / "hf").exists()


def test_online_load_needs_the_same_model(vlm):
    """Loading a Qwen2.5-VL directory into a text-only model (or one with another ViT) says what differs."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loong_ckpt.mcore_io import _single_process_megatron
    from loong_ckpt.online import load_hf_weights, read_hf_model
    from loong_models import build_foundation, build_transformer_config

    cfg = read_hf_model(vlm.hf)
    wider = dataclasses.replace(cfg, image_encoder=dataclasses.replace(cfg.image_encoder, ffn_hidden_size=48))
    with _single_process_megatron():
        model_parallel_cuda_manual_seed(0)
        tconfig = build_transformer_config(
            cfg.foundation, use_cpu_initialization=True, params_dtype=torch.float32
        )
        model = build_foundation(cfg.foundation, tconfig, layer_backend="local")
        with pytest.raises(ConversionError, match="image_encoder: .*ImageEncoderConfig.* \\(HF\\) != None"):
            load_hf_weights(vlm.hf, [model], cfg.foundation)
        with pytest.raises(ConversionError, match=r"image_encoder\.ffn_hidden_size: 40 \(HF\) != 48"):
            load_hf_weights(vlm.hf, [model], wider)


# (tp, pp, encoder tp, sources): the ViT split with the foundation; the ViT and projector whole on
# each rank (encoder TP=1; only the online load: megatron's dist-checkpoint load of that layout
# rejects the projector's replicated tensors (duplicate replica ids), a loong-models issue); PP=2
# with the encoder and projector on the first stage.
VLM_LAYOUTS = [(2, 1, None, ("ckpt", "hf")), (2, 1, 1, ("hf",)), (1, 2, None, ("ckpt", "hf"))]


@pytest.mark.dist
def test_parallel_logits_match_hf(vlm, tmp_path):
    """One torchrun launch, 2 processes, gloo, three layouts (VLM_LAYOUTS), each from the converted
    checkpoint and / or the HF directory loaded online: the logits equal HF's."""
    sources = {"ckpt": vlm.ckpt, "hf": vlm.hf}
    jobs = [dict(source=str(sources[kind]), tokens=str(vlm.tokens), out=str(tmp_path / f"{kind}-{tp}-{pp}-{etp}.pt"),
                 tp=tp, pp=pp, encoder_tp=etp)
            for tp, pp, etp, kinds in VLM_LAYOUTS for kind in kinds]  # fmt: skip
    for job, logits in zip(jobs, run_layouts(jobs), strict=True):
        assert logits.shape == vlm.ref.shape
        diff = (logits - vlm.ref).abs().max().item()
        layout = f"tp={job['tp']} pp={job['pp']} encoder tp={job['encoder_tp']}"
        assert diff <= TOL, f"{job['source']} at {layout}: max abs diff {diff}"
