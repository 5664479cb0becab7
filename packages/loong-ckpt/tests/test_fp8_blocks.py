"""FP8 block-quantised HF checkpoints (DeepSeek-V3's released format) are dequantised on load:
converting one gives exactly the checkpoint of its dequantised weights, and export writes plain
weights without the quantisation config."""

from __future__ import annotations

import json

import pytest
import torch

from loong_ckpt.fp8_blocks import dequantize, quantize
from loong_ckpt.hf_config import ConversionError
from loong_ckpt.testing.hf_models import make_hf_model

BLOCK = (16, 16)


def test_block_quantisation_round_trips_within_e4m3_precision_on_ragged_shapes():
    w = torch.randn(40, 72)  # neither dimension a multiple of the block
    q, scale_inv = quantize(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 5)
    back = dequantize(q, scale_inv, BLOCK, torch.float32)
    assert ((back - w).abs() <= w.abs() * 2**-3 + 1e-6).all()  # e4m3: 3 mantissa bits
    with pytest.raises(ConversionError, match=r"needs scales \(3, 5\), got \(3, 4\)"):
        dequantize(q, scale_inv[:, :4], BLOCK, torch.float32)


def _quantised_copy(src, fp8_dir, deq_dir):
    """The HF model at ``src`` with every decoder linear weight FP8 block-quantised (``fp8_dir``)
    and the same model with those weights dequantised again (``deq_dir``)."""
    from safetensors.torch import load_file, save_file

    tensors = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    fp8, deq = {}, {}
    for name, t in tensors.items():
        quantised = name.startswith("model.layers.") and name.endswith("proj.weight") and t.dim() == 2
        if quantised:
            q, s = quantize(t, BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = dequantize(q, s, BLOCK, t.dtype)
        else:
            fp8[name] = deq[name] = t
    config = json.loads((src / "config.json").read_text())
    for out, ts, cfg in ((fp8_dir, fp8, {**config, "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}}),
            (deq_dir, deq, config)):  # fmt: skip
        out.mkdir()
        save_file(ts, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(cfg))
    return sum(n.endswith("_scale_inv") for n in fp8)


def _tensors(ckpt):
    from loong_ckpt.mcore_io import read_metadata, read_regions

    stored = {k: v for k, v in read_metadata(ckpt).items() if not k.startswith("optimizer")}
    regions = {k: ((0,) * len(v.size), torch.empty(tuple(v.size), dtype=v.properties.dtype)) for k, v in stored.items()}
    read_regions(ckpt, regions)
    return {k: t for k, (_, t) in regions.items()}


def test_a_deepseek_v3_fp8_checkpoint_converts_to_its_dequantised_weights_and_exports_unquantised(tmp_path):
    from loong_ckpt import hf_to_mcore, mcore_to_hf

    src = make_hf_model(tmp_path / "hf", "deepseek-v3")
    assert _quantised_copy(src, tmp_path / "fp8", tmp_path / "deq") > 10
    hf_to_mcore(tmp_path / "fp8", tmp_path / "ckpt-fp8", progress=False)
    hf_to_mcore(tmp_path / "deq", tmp_path / "ckpt-deq", progress=False)
    a, b = _tensors(tmp_path / "ckpt-fp8"), _tensors(tmp_path / "ckpt-deq")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)

    mcore_to_hf(tmp_path / "ckpt-fp8", tmp_path / "out", progress=False)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in exported
    from safetensors.torch import load_file

    out = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(f).items()}
    want = load_file(tmp_path / "deq" / "model.safetensors")
    assert sorted(out) == sorted(want) and all(torch.equal(out[k], want[k]) for k in out)


def test_an_fp8_weight_without_scales_and_other_quantisations_are_refused(tmp_path):
    from safetensors.torch import save_file

    from loong_ckpt.hf_io import HFReader

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8",
                                                                               "weight_block_size": [16, 16]}}))  # fmt: skip
    save_file({"w.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"FP8 tensor w.weight has no w.weight_scale_inv"):
        HFReader(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ConversionError, match=r"quant_method='gptq'; only FP8 block quantisation"):
        HFReader(tmp_path)


def _hf_tensors(path):
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_export_as_fp8_blocks_writes_the_release_format_and_converting_it_back_is_consistent(tmp_path):
    from loong_ckpt import hf_to_mcore, mcore_to_hf
    from loong_ckpt.cli import main

    src = make_hf_model(tmp_path / "hf", "deepseek-v3")
    hf_to_mcore(src, tmp_path / "ckpt", progress=False)
    assert main(["mcore-to-hf", str(tmp_path / "ckpt"), str(tmp_path / "fp8"), "--fp8-blocks", "16,16",
                 "--no-progress"]) == 0  # fmt: skip
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [16, 16]
    orig, fp8 = _hf_tensors(src), _hf_tensors(tmp_path / "fp8")
    quantised = [n for n in orig if n + "_scale_inv" in fp8]
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in quantised and "model.layers.0.self_attn.kv_b_proj.weight" in quantised
    assert sorted(fp8) == sorted([*orig, *(n + "_scale_inv" for n in quantised)])
    for name, want in orig.items():  # quantised weights: exactly quantize(w); the rest unchanged
        if name in quantised:
            q, s = quantize(want, BLOCK)
            assert fp8[name].dtype == torch.float8_e4m3fn and torch.equal(fp8[name].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(fp8[name + "_scale_inv"], s)
        else:
            assert torch.equal(fp8[name], want), name
    assert not any(n.endswith(("norm.weight", "mlp.gate.weight", "embed_tokens.weight")) for n in quantised)

    # back: the checkpoint holds the dequantised weights, and exporting it again gives the same FP8 blocks
    hf_to_mcore(tmp_path / "fp8", tmp_path / "ckpt2", progress=False)
    mcore_to_hf(tmp_path / "ckpt2", tmp_path / "plain", progress=False)
    plain = _hf_tensors(tmp_path / "plain")
    assert sorted(plain) == sorted(orig)
    for name, t in plain.items():
        want = dequantize(fp8[name], fp8[name + "_scale_inv"], BLOCK, t.dtype) if name in quantised else orig[name]
        assert torch.equal(t, want), name
    assert main(["mcore-to-hf", str(tmp_path / "ckpt2"), str(tmp_path / "fp8-again"), "--fp8-blocks", "16",
                 "--no-progress"]) == 0  # fmt: skip
    again = _hf_tensors(tmp_path / "fp8-again")
    assert sorted(again) == sorted(fp8)
    assert all(torch.equal(again[k].view(torch.uint8), fp8[k].view(torch.uint8)) if again[k].dtype == torch.float8_e4m3fn
               else torch.equal(again[k], fp8[k]) for k in fp8)  # fmt: skip


def test_a_malformed_fp8_block_option_is_refused_naming_it():
    from loong_ckpt.fp8_blocks import parse_block

    assert parse_block("128") == (128, 128) and parse_block("64,128") == (64, 128)
    with pytest.raises(ConversionError, match=r"--fp8-blocks='128x128'; expected a block size such as 128"):
        parse_block("128x128")


def test_the_online_load_of_an_fp8_checkpoint_gives_the_logits_of_the_dequantised_hf_model(tmp_path):
    from loong_ckpt.testing import logits_in_process
    from loong_ckpt.testing.hf_models import hf_logits

    _quantised_copy(make_hf_model(tmp_path / "hf", "deepseek-v3"), tmp_path / "fp8", tmp_path / "deq")
    tokens = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    got = logits_in_process(tmp_path / "fp8", tmp_path / "tokens.pt")  # train.init_from=<HF dir>'s loader
    torch.testing.assert_close(got, hf_logits(tmp_path / "deq", tokens), atol=2e-4, rtol=1e-4)
    assert (got - hf_logits(tmp_path / "hf", tokens)).abs().max() > 1e-4  # FP8 did change the weights
