"""Qwen3-VL through the composed mapping: a tiny random HF ``Qwen3VLForConditionalGeneration``
(LayerNorm ViT with learned + 2-D rotary positions, DeepStack, a Qwen3 LLM with interleaved
multimodal RoPE) converts to Loong's OmniCombinationModel and back; logits match HF on a real image
+ text (fp32, CPU); HF -> Megatron -> HF is bit-identical; DeepStack and the interleaved RoPE are
each needed for the match."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loong_ckpt import ConversionError, hf_to_mcore, mcore_to_hf
from loong_ckpt.testing import get_converted_qwen3_vl, logits_in_process
from loong_ckpt.testing.hf_models import VLM_TOKENS, hf_vlm_logits

TOL = 1e-4  # as test_convert_vlm.py


@pytest.fixture(scope="session")
def qwen3_vl(tmp_path_factory):
    return get_converted_qwen3_vl(tmp_path_factory)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _loong_logits(source: Path, inputs: Path, alter) -> torch.Tensor:
    """Loong logits of ``source`` (TP = PP = 1), the loaded model first changed by ``alter``."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loong_ckpt.mcore_io import _single_process_megatron
    from loong_ckpt.online import load_hf_weights, read_hf_model
    from loong_models import build_model, build_transformer_config

    cfg = dataclasses.replace(read_hf_model(source), layer_backend="local")
    media = torch.load(inputs)
    ids = media.pop("input_ids")
    with _single_process_megatron():
        model_parallel_cuda_manual_seed(0)
        tconfig = build_transformer_config(
            cfg.foundation, use_cpu_initialization=True, params_dtype=torch.float32
        )
        model = build_model(cfg, tconfig, device_type="cpu")
        load_hf_weights(source, [model], cfg)
        model.eval()
        alter(model)
        with torch.no_grad():
            return model(ids, None, None, **media)[..., : cfg.foundation.vocab_size]


def test_config_is_read_as_qwen3_vl(qwen3_vl):
    meta = json.loads((qwen3_vl.ckpt / "loong.json").read_text())
    enc = meta["model"]["image_encoder"]
    assert enc["type"] == "qwen3-vit" and enc["deepstack_visual_indexes"] == [2, 0]
    assert enc["image_size"] == 6 * 16  # a 6 x 6 learned position table of 16 px patches
    assert meta["foundation"]["family"] == "qwen3" and meta["foundation"]["mrope_interleaved"] is True
    assert meta["hf_naming"] == "modules"


def test_logits_match_hf(qwen3_vl):
    inputs = torch.load(qwen3_vl.tokens)
    grid = inputs["image_grid_thw"][0].tolist()
    assert grid[1:] != [6, 6]  # the position table is resized for this image
    assert int((inputs["input_ids"] == VLM_TOKENS["image_token_id"]).sum()) > 8  # the image is really in it
    logits = logits_in_process(qwen3_vl.ckpt, qwen3_vl.tokens)
    assert logits.shape == qwen3_vl.ref.shape
    assert (logits - qwen3_vl.ref).abs().max().item() <= TOL


def test_online_hf_load_matches_hf(qwen3_vl):
    online = logits_in_process(qwen3_vl.hf, qwen3_vl.tokens)
    assert (online - qwen3_vl.ref).abs().max().item() <= TOL
    assert torch.equal(online, logits_in_process(qwen3_vl.ckpt, qwen3_vl.tokens))


def test_deepstack_and_interleaved_rope_are_each_needed(qwen3_vl):
    """With megatron's block-layout multimodal RoPE (Qwen2.5-VL's) in place of the interleaved
    one, or with the DeepStack mergers' output zeroed, the logits leave HF's: the parity above
    checks both."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    def blocks(model):
        model.foundation.rotary_pos_emb.__class__ = MultimodalRotaryEmbedding

    def no_deepstack(model):
        with torch.no_grad():
            for merger in model.image_projector.deepstack:
                merger.mlp.linear_fc2.weight.zero_()
                merger.mlp.linear_fc2.bias.zero_()

    same = _loong_logits(qwen3_vl.hf, qwen3_vl.tokens, lambda model: None)
    assert (same - qwen3_vl.ref).abs().max().item() <= TOL
    for alter in (blocks, no_deepstack):
        assert (
            _loong_logits(qwen3_vl.hf, qwen3_vl.tokens, alter) - qwen3_vl.ref
        ).abs().max().item() > 100 * TOL


def test_round_trip_is_bit_identical(qwen3_vl, tmp_path):
    import transformers

    out = tmp_path / "hf"
    mcore_to_hf(qwen3_vl.ckpt, out, progress=False)
    a, b = _tensors(qwen3_vl.hf), _tensors(out)
    assert sorted(a) == sorted(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (qwen3_vl.hf / "config.json").read_text()
    )
    assert isinstance(transformers.AutoConfig.from_pretrained(out), transformers.Qwen3VLConfig)
    assert torch.equal(hf_vlm_logits(out, torch.load(qwen3_vl.tokens)), qwen3_vl.ref)


def test_generated_config_loads_in_transformers(qwen3_vl, tmp_path):
    """A checkpoint without the source config.json (trained in Loong) gets a generated one that
    transformers reads as the same Qwen3-VL: same weights, same logits."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(qwen3_vl.ckpt, ckpt)
    meta = json.loads((ckpt / "loong.json").read_text())
    del meta["hf_config"]
    (ckpt / "loong.json").write_text(json.dumps(meta))
    mcore_to_hf(ckpt, tmp_path / "hf", progress=False)
    got = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert got["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert got["vision_config"]["deepstack_visual_indexes"] == [2, 0]
    assert got["text_config"]["rope_parameters"]["mrope_interleaved"] is True
    assert torch.equal(hf_vlm_logits(tmp_path / "hf", torch.load(qwen3_vl.tokens)), qwen3_vl.ref)


def _edited(src: Path, dst: Path, edit) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c["vision_config"].update(hidden_act="silu"),
         "vision_config.hidden_act='silu' is not supported for Qwen3-VL; allowed: 'gelu_pytorch_tanh'"),
        (lambda c: c["vision_config"].update(num_position_embeddings=35), "num_position_embeddings=35 is not a square"),
        (lambda c: c["vision_config"].update(deepstack_visual_indexes=[0, 5]),
         r"deepstack_visual_indexes has \[5\], outside 0..2"),
        (lambda c: c["text_config"]["rope_parameters"].pop("mrope_section"), "mrope_section=None; expected 3 integers"),
    ],
    ids=["vision-act", "position-table", "deepstack-layer", "no-mrope"],
)  # fmt: skip
def test_unsupported_variants_name_the_key(qwen3_vl, tmp_path, edit, message):
    hf = _edited(qwen3_vl.hf, tmp_path / "hf", edit)
    with pytest.raises(ConversionError, match=message):
        hf_to_mcore(hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_interleaved_sections_match_transformers():
    """The frequency layout against transformers' own Qwen3-VL rotary embedding, at Qwen3-VL's
    real sizes (head dim 128, sections [24, 20, 20])."""
    import transformers
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from loong_models.foundation.mrope import interleave_sections

    cfg = transformers.Qwen3VLTextConfig(
        head_dim=128,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20]},
    )
    rope = Qwen3VLTextRotaryEmbedding(cfg)
    pos = torch.stack([torch.arange(7), torch.arange(7) * 3 + 1, torch.arange(7) * 5 + 2])[:, None, :]
    cos, _ = rope(torch.zeros(1, dtype=torch.float32), pos)
    freqs = interleave_sections(pos[..., None].float() * rope.inv_freq, [24, 20, 20])
    assert torch.allclose(torch.cat([freqs, freqs], -1).cos(), cos, atol=1e-6)


@pytest.mark.dist
def test_tp2_logits_match_hf(qwen3_vl, tmp_path):
    """torchrun, 2 processes, gloo, TP=2: the ViT, both kinds of merger and the LLM split over 2
    ranks, from the converted checkpoint and from the HF directory loaded online (each rank reads
    its share of q, k, v and of every merger)."""
    from loong_ckpt.testing import run_workers

    jobs = [(src, qwen3_vl.tokens, tmp_path / f"{kind}.pt") for kind, src in (("ckpt", qwen3_vl.ckpt),
                                                                              ("hf", qwen3_vl.hf))]  # fmt: skip
    for (src, _, _), logits in zip(jobs, run_workers(jobs, tp=2, pp=1)):
        assert logits.shape == qwen3_vl.ref.shape
        assert (logits - qwen3_vl.ref).abs().max().item() <= TOL, src
