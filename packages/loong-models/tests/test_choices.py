"""Every choice of a model config is an enum: a bad value fails when the config is composed, and
the error names the key and the allowed values (OmegaConf's check, no hand-written one)."""

import pytest
from omegaconf.errors import ValidationError

from loong_models import ENCODER_TYPES, FAMILIES, load_model_config


@pytest.mark.parametrize(
    "model, override, key, allowed",
    [
        ("tiny", "foundation.family=mamba", "foundation.family", ", ".join(FAMILIES)),
        ("tiny", "+foundation.recompute=some", "foundation.recompute", "selective, full"),
        ("tiny", "layer_backend=fast", "layer_backend", "auto, te, local"),
        ("tiny", "+foundation.recompute_modules=[attn]", "foundation.recompute_modules[0]",
         "core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts"),
        ("qwen3-moe-tiny", "foundation.moe.score_function=relu", "foundation.moe.score_function", "softmax, sigmoid"),
        ("qwen3-moe-tiny", "foundation.moe.load_balancing=switch", "foundation.moe.load_balancing",
         "aux_loss, seq_aux_loss, global_aux_loss, none"),
        ("qwen3-moe-tiny", "foundation.moe.token_drop_policy=random", "foundation.moe.token_drop_policy",
         "probs, position"),
        ("qwen3-moe-tiny", "+foundation.moe.router_dtype=bf16", "foundation.moe.router_dtype", "fp32, fp64"),
        ("deepseek-v3-tiny", "+foundation.rope_scaling.type=ntk", "foundation.rope_scaling.type", "llama3, yarn"),
        ("tiny-vlm", "image_encoder.type=clip", "image_encoder.type", ", ".join(ENCODER_TYPES)),
        ("tiny-vlm", "image_encoder.recompute=some", "image_encoder.recompute", "selective, full"),
        ("tiny-vlm", "image_projector.type=conv", "image_projector.type", "mlp"),
        ("tiny-vlm", "image_projector.norm=BatchNorm", "image_projector.norm", "RMSNorm, LayerNorm"),
        ("tiny-vlm", "image_projector.activation=relu", "image_projector.activation", "gelu, gelu_tanh, silu"),
        ("wan-tiny", "diffusion.recompute=selective", "diffusion.recompute", "full, keep_attention"),
        ("wan-tiny", "flow_matching.weighting=cosine", "flow_matching.weighting", "bell, uniform"),
    ],
)  # fmt: skip
def test_a_bad_choice_names_the_key_and_the_allowed_values(model, override, key, allowed):
    with pytest.raises(ValidationError, match=rf"Invalid value '.*', expected one of \[{allowed}\]") as e:
        load_model_config(model, [override])
    assert e.value.full_key == key


def test_choices_keep_their_yaml_spelling_and_compare_as_strings():
    f = load_model_config("qwen3-moe-tiny", ["+foundation.recompute=selective",
                                             "+foundation.recompute_modules=[moe_act, layernorm]"]).foundation  # fmt: skip
    assert f.family == "qwen3-moe" and f"{f.family}" == "qwen3-moe" and str(f.family) == "qwen3-moe"
    assert f.recompute == "selective" and f.recompute_modules == ["moe_act", "layernorm"]
    assert f.moe.score_function == "softmax" and f.moe.router_dtype == "fp32"
    vlm = load_model_config("tiny-vlm", ["image_projector.norm=LayerNorm", "layer_backend=local"])
    assert vlm.image_projector.norm == "LayerNorm" and vlm.image_encoder.type == "qwen2.5-vit"
    assert vlm.layer_backend == "local" and {"LayerNorm": 2}[vlm.image_projector.norm] == 2
