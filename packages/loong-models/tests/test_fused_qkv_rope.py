"""``model.fused_qkv_rope``: megatron's fused_single_qkv_rope on the TE backend, off by default; the
model refuses what megatron's fused QKV RoPE cannot take. Its numerics need TE on a GPU
(packages/loong-parallel/tests/test_fused_qkv_rope_gpu.py)."""

from __future__ import annotations

import pytest

from loong_models import ModelConfig, fusion_fields, load_model_config


def test_fused_qkv_rope_is_off_by_default_and_needs_te_layers():
    assert not load_model_config("llama3.2-1b").fused_qkv_rope
    assert fusion_fields("te")["fused_single_qkv_rope"] is False
    assert fusion_fields("te", fused_qkv_rope=True)["fused_single_qkv_rope"] is True
    assert fusion_fields("local", fused_qkv_rope=True)["fused_single_qkv_rope"] is False


@pytest.mark.parametrize(
    "model, key",
    [
        ("qwen3-0.6b", r"model\.foundation\.family=qwen3 \(QK norms\)"),
        ("deepseek-v3-tiny", r"model\.foundation\.mla"),
        ("tiny-qwen3-vl", r"model\.foundation\.mrope_section"),
    ],
)
def test_fused_qkv_rope_refuses_normed_latent_or_multimodal_rope(model, key):
    with pytest.raises(ValueError, match=rf"^model\.fused_qkv_rope=true cannot be combined with {key}:"):
        load_model_config(model, ["+fused_qkv_rope=true"])
    load_model_config(model).validate()


def test_a_gated_attention_is_refused_by_name():
    cfg = ModelConfig(fused_qkv_rope=True)
    cfg.foundation.extra["attention_output_gate"] = True
    with pytest.raises(ValueError, match=r"model\.foundation\.extra\.attention_output_gate"):
        cfg.validate()
