"""``model.fused_mlp``: dense SwiGLU MLPs as megatron's TEFusedMLP (TE's operation fuser) on the TE
backend. The CPU checks the decision and the refusals; the module and its numerics need TE on a
GPU (packages/loong-parallel/tests/test_vlm_step_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from loong_models import (
    FoundationConfig,
    LoraConfig,
    ModelConfig,
    build_transformer_config,
    fusion_fields,
    load_model_config,
)
from loong_models.image_encoder import build_encoder_transformer_config
from loong_models.precision import PrecisionConfig
from loong_models.specs import LayerShape, layer_spec, spec_provider, uses_te_op_fuser


def _configs(fused_mlp: bool, backend: str = "te"):
    cfg = load_model_config("tiny-vlm", [f"+fused_mlp={str(fused_mlp).lower()}"])
    fields = fusion_fields(backend, fused_mlp=cfg.fused_mlp)
    fields["apply_rope_fusion"] = False  # needs TE installed
    base = build_transformer_config(cfg.foundation, params_dtype=torch.float32, **fields)
    enc = build_encoder_transformer_config(cfg.image_encoder, base, tensor_model_parallel_size=1, backend=backend)
    return base, enc


@pytest.mark.parametrize("fused_mlp", [False, True])
def test_fused_mlp_is_the_foundations_choice_and_the_swiglu_encoder_follows_it(fused_mlp):
    base, enc = _configs(fused_mlp)
    assert (uses_te_op_fuser(base), uses_te_op_fuser(enc)) == (fused_mlp, fused_mlp)


def test_fused_mlp_needs_te_layers_and_a_swiglu_mlp():
    base, enc = _configs(True, backend="local")
    assert not uses_te_op_fuser(base) and not uses_te_op_fuser(enc)
    gelu = build_transformer_config(load_model_config("tiny").foundation, params_dtype=torch.float32,
                                    gated_linear_unit=False, activation_func=torch.nn.functional.gelu,
                                    add_bias_linear=True,
                                    **{**fusion_fields("te", fused_mlp=True), "apply_rope_fusion": False})  # fmt: skip
    assert gelu.use_transformer_engine_op_fuser and not uses_te_op_fuser(gelu)  # TE's GELU op is tanh-approximate


def test_a_backend_without_fused_norm_linears_keeps_megatrons_mlp():
    from megatron.core.transformer.mlp import MLP

    mlp = layer_spec(spec_provider("local"), LayerShape(te_op_fuser=True)).submodules.mlp
    assert mlp.func.__self__ is MLP


@pytest.mark.parametrize(
    "fields, key",
    [
        (dict(lora=LoraConfig()), "model.lora"),
        (dict(foundation=FoundationConfig(precision=PrecisionConfig(fp8="adaptive", policy="p.json"))),
         "model.foundation.precision.fp8=adaptive"),
        (dict(foundation=load_model_config("qwen3-moe-tiny").foundation), "model.foundation.moe"),
    ],
    ids=["lora", "adaptive-fp8", "moe"],
)
def test_fused_mlp_refuses_what_works_through_the_mlps_linears_and_null_leaves_it_off(fields, key):
    with pytest.raises(ValueError, match=rf"^model\.fused_mlp=true cannot be combined with {key}:"):
        ModelConfig(fused_mlp=True, **fields).validate()
    default = ModelConfig(**fields)
    default.validate()
    assert default.fused_mlp is None and not default.uses_fused_mlp()


def test_fused_mlp_is_on_by_default_and_off_when_asked():
    assert load_model_config("tiny-vlm").uses_fused_mlp()
    assert not load_model_config("tiny-vlm", ["+fused_mlp=false"]).uses_fused_mlp()


def test_an_encoder_at_its_own_tp_size_keeps_megatrons_mlp():
    # megatron's TEFusedMLP takes its TP group from the global parallel state, not the module's
    cfg = load_model_config("tiny-vlm", ["+fused_mlp=true"])
    fields = {**fusion_fields("te", fused_mlp=True), "apply_rope_fusion": False}
    base = build_transformer_config(cfg.foundation, params_dtype=torch.float32, tensor_model_parallel_size=2,
                                    **fields)  # fmt: skip
    own = build_encoder_transformer_config(cfg.image_encoder, base, tensor_model_parallel_size=1, backend="te")
    same = build_encoder_transformer_config(cfg.image_encoder, base, tensor_model_parallel_size=2, backend="te")
    assert (uses_te_op_fuser(own), uses_te_op_fuser(same)) == (False, True)
