"""DeepSeek-V3.2 with its multi-token-prediction layer, as the release stores it (HF layer
num_hidden_layers: a DSA decoder layer with its own indexer, plus enorm / hnorm / eh_proj /
shared_head): conversion maps it onto megatron's MTP block and back bit-identically, offline and
online; the main logits equal HF's and the MTP logits equal DeepSeek's MTP definition computed on
HF's own DeepseekV32 layer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from loong_ckpt.testing.hf_models import add_mtp_layers, hf_logits, make_hf_model
from loong_ckpt.testing.mtp import hf_tensors, loong_logits_with_mtp, reference_mtp_logits

PADDED_VOCAB = 1024  # the tiny models' 1000 tokens, padded to a multiple of 128
SEQ = 24  # the tiny model's index_topk is 8: queries past 8 drop keys, in the MTP layer too


@pytest.fixture(scope="module")
def v32mtp(tmp_path_factory):
    from loong_ckpt import hf_to_mcore

    base = tmp_path_factory.mktemp("v32mtp")
    hf = add_mtp_layers(make_hf_model(base / "hf", "deepseek-v32"))
    hf_to_mcore(hf, base / "ckpt", progress=False)
    tokens = torch.randint(0, 1000, (2, SEQ), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, base / "tokens.pt")
    return hf, base / "ckpt", tokens, base


def test_the_mtp_layer_with_its_indexer_converts_to_megatrons_mtp_block_and_back_bit_identically(
    v32mtp, tmp_path
):
    from loong_ckpt import mcore_to_hf
    from loong_ckpt.mcore_io import read_metadata

    hf, ckpt, _, _ = v32mtp
    assert json.loads((ckpt / "loong.json").read_text())["foundation"]["mtp_num_layers"] == 1
    keys = set(read_metadata(ckpt))
    layer = "mtp.layers.0.transformer_layer."
    assert {"mtp.layers.0.eh_proj.weight", layer + "self_attention.core_attention.indexer.linear_wq_b.weight",
            layer + "self_attention.core_attention.indexer.k_norm.bias",
            layer + "mlp.experts.experts.linear_fc1.weight"} <= keys  # fmt: skip
    mcore_to_hf(ckpt, tmp_path / "back", progress=False)
    src, back = hf_tensors(hf), hf_tensors(tmp_path / "back")
    assert "model.layers.2.self_attn.indexer.weights_proj.weight" in src and sorted(back) == sorted(src)
    assert all(back[k].dtype == src[k].dtype and torch.equal(back[k], src[k]) for k in src)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads(
        (hf / "config.json").read_text()
    )

    shutil.copytree(ckpt, tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "loong.json").read_text())
    meta["hf_config"] = None  # the generated config.json names the MTP layers too
    (tmp_path / "ckpt" / "loong.json").write_text(json.dumps(meta))
    mcore_to_hf(tmp_path / "ckpt", tmp_path / "generated", progress=False)
    generated = json.loads((tmp_path / "generated" / "config.json").read_text())
    assert generated["num_nextn_predict_layers"] == 1 and generated["index_topk"] == 8
    assert sorted(hf_tensors(tmp_path / "generated")) == sorted(src)


@pytest.mark.parametrize("source", ["checkpoint", "hf-dir"])
def test_main_logits_match_hf_and_mtp_logits_match_deepseeks_mtp_on_hf_v32_modules(v32mtp, source):
    hf, ckpt, tokens, base = v32mtp
    main, mtp = loong_logits_with_mtp(
        ckpt if source == "checkpoint" else hf, base / "tokens.pt", PADDED_VOCAB
    )
    torch.testing.assert_close(main, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)
    want = reference_mtp_logits(hf, tokens)
    torch.testing.assert_close(mtp[:, :-1], want, atol=2e-4, rtol=1e-4)
    assert (mtp[:, :-1] - main[:, 1:]).abs().max() > 1e-2  # the MTP layer is not the decoder again


# --- FP8 blocks in DeepSeek-V3.2's release layout ------------------------------------------------

BLOCK = (16, 16)  # the release's is 128 x 128; 16 gives the tiny weights several blocks each
# The weights DeepSeek-V3.2-Exp's release stores as float8_e4m3fn + fp32 weight_scale_inv, in every
# layer (decoder and MTP); its indexer's weights_proj is bf16 and k_norm fp32, the router's
# e_score_correction_bias fp32, the rest (embeddings, norms, router, eh_proj, LM head) bf16.
RELEASE_FP8 = {f"self_attn.{p}.weight" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                                 "indexer.wq_b", "indexer.wk")} | {
    f"mlp.{m}{p}.weight" for m in ("", "shared_experts.", "experts.E.") for p in ("gate_proj", "up_proj", "down_proj")
}  # fmt: skip
RELEASE_FP32 = {
    "self_attn.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias",
    "mlp.gate.e_score_correction_bias",
}
RELEASE_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                        "weight_block_size": list(BLOCK)}  # fmt: skip


def _in_layer(name: str) -> str | None:
    """``model.layers.<i>.<rest>`` -> rest, with an expert index as ``E``; None for other tensors."""
    import re

    m = re.match(r"model\.layers\.\d+\.(.+)$", name)
    return re.sub(r"experts\.\d+\.", "experts.E.", m.group(1)) if m else None


def _release_fp8(name: str) -> bool:
    return _in_layer(name) in RELEASE_FP8


def test_fp8_export_writes_deepseek_v32s_release_layout_and_reimport_gives_the_dequantised_weights(
    v32mtp, tmp_path
):
    from loong_ckpt import hf_to_mcore, mcore_to_hf
    from loong_ckpt.cli import main
    from loong_ckpt.fp8_blocks import dequantize, quantize

    hf, ckpt, _, _ = v32mtp
    assert main(["mcore-to-hf", str(ckpt), str(tmp_path / "fp8"), "--fp8-blocks", "16", "--no-progress"]) == 0
    assert (
        json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
        == RELEASE_QUANTIZATION
    )
    orig, fp8 = hf_tensors(hf), hf_tensors(tmp_path / "fp8")
    quantised = sorted(n for n in orig if _release_fp8(n))
    assert {"model.layers.2.self_attn.indexer.wk.weight", "model.layers.2.mlp.experts.3.up_proj.weight",
            "model.layers.0.self_attn.indexer.wq_b.weight"} <= set(quantised)  # fmt: skip
    assert sorted(fp8) == sorted([*orig, *(n + "_scale_inv" for n in quantised)])
    for name, want in orig.items():
        if name not in quantised:
            assert fp8[name].dtype == want.dtype and torch.equal(fp8[name], want), name
            continue
        q, s = quantize(want, BLOCK, "ue8m0")
        scale = fp8[name + "_scale_inv"]
        assert scale.dtype == torch.float32 and scale.shape == (
            -(-want.shape[0] // 16),
            -(-want.shape[1] // 16),
        )
        assert torch.equal(scale, torch.exp2(torch.log2(scale).round())), f"{name}: scales not powers of two"
        assert torch.equal(scale, s) and torch.equal(fp8[name].view(torch.uint8), q.view(torch.uint8)), name

    hf_to_mcore(tmp_path / "fp8", tmp_path / "ckpt2", progress=False)
    mcore_to_hf(tmp_path / "ckpt2", tmp_path / "plain", progress=False)
    plain = hf_tensors(tmp_path / "plain")
    assert sorted(plain) == sorted(orig)
    for name, t in plain.items():
        want = (
            dequantize(fp8[name], fp8[name + "_scale_inv"], BLOCK, t.dtype)
            if name in quantised
            else orig[name]
        )
        assert torch.equal(t, want), name
    assert any(not torch.equal(plain[n], orig[n]) for n in quantised)  # FP8 did round the weights


def _release_style_copy(src, fp8_dir, deq_dir) -> None:
    """The HF model at ``src`` as DeepSeek-V3.2's release stores it (``fp8_dir``: bf16 with FP8
    blocks and UE8M0 scales per RELEASE_FP8, fp32 per RELEASE_FP32, quantization_config) and the
    same weights dequantised, without quantization_config (``deq_dir``)."""
    from safetensors.torch import save_file

    from loong_ckpt.fp8_blocks import dequantize, quantize

    fp8, deq = {}, {}
    for name, t in hf_tensors(src).items():
        t = t.to(torch.float32 if _in_layer(name) in RELEASE_FP32 else torch.bfloat16)
        if _release_fp8(name):
            q, s = quantize(t, BLOCK, "ue8m0")
            fp8[name], fp8[name + "_scale_inv"], deq[name] = q, s, dequantize(q, s, BLOCK, torch.bfloat16)
        else:
            fp8[name] = deq[name] = t
    config = {**json.loads((src / "config.json").read_text()), "dtype": "bfloat16"}
    for out, tensors, cfg in ((fp8_dir, fp8, {**config, "quantization_config": RELEASE_QUANTIZATION}),
                              (deq_dir, deq, config)):  # fmt: skip
        out.mkdir()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg))


def test_a_release_style_fp8_v32_checkpoint_with_mtp_loads_as_its_dequantised_weights_and_exports_back(
    v32mtp, tmp_path
):
    from loong_ckpt import hf_to_mcore, mcore_to_hf
    from loong_ckpt.cli import main
    from loong_ckpt.testing import logits_in_process

    hf, _, _, base = v32mtp
    _release_style_copy(hf, tmp_path / "fp8", tmp_path / "deq")
    for name in ("fp8", "deq"):
        hf_to_mcore(tmp_path / name, tmp_path / f"ckpt-{name}", progress=False)
        mcore_to_hf(tmp_path / f"ckpt-{name}", tmp_path / f"out-{name}", progress=False)
    a, b = hf_tensors(tmp_path / "out-fp8"), hf_tensors(tmp_path / "out-deq")
    assert sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    online = logits_in_process(tmp_path / "fp8", base / "tokens.pt")  # train.init_from=<HF dir>'s loader
    assert torch.equal(online, logits_in_process(tmp_path / "deq", base / "tokens.pt"))

    # export in the release layout again: the same names and dtypes, FP8 weights whose UE8M0
    # scales re-quantise the same values exactly (a block whose largest value the first rounding
    # brought down to 224 gets half the scale: other bytes, the same weights); k_norm was loaded in
    # the model's dtype (bf16, as transformers loads it), so its fp32 values come back rounded to bf16
    from loong_ckpt.fp8_blocks import dequantize

    args = ["mcore-to-hf", str(tmp_path / "ckpt-fp8"), str(tmp_path / "again"), "--fp8-blocks", "16"]
    assert main([*args, "--no-progress"]) == 0
    release, again = hf_tensors(tmp_path / "fp8"), hf_tensors(tmp_path / "again")
    assert sorted(again) == sorted(release)
    for name, want in release.items():
        got = again[name]
        assert got.dtype == want.dtype, name
        if name.endswith("_scale_inv"):
            assert torch.equal(got, torch.exp2(torch.log2(got).round())), name
        elif got.dtype == torch.float8_e4m3fn:
            scales = again[name + "_scale_inv"], release[name + "_scale_inv"]
            got, want = (
                dequantize(got, scales[0], BLOCK, torch.float32),
                dequantize(want, scales[1], BLOCK, torch.float32),
            )
        elif _in_layer(name) in ("self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias"):
            want = want.to(torch.bfloat16).float()
        if not name.endswith("_scale_inv"):
            assert torch.equal(got, want), name
