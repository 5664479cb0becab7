"""LanguageModel decides the MLP and the FP8 fields together: adaptive FP8 whose policy picks BF16
for every GEMM kind at the run's shapes is the plain BF16 model (no FP8 field, TE's op-fuser MLP as
by default); where FP8 wins for some kind, the MLP stays megatron's, whose linears read their own
decisions. A real policy file and megatron's RecipeConfig (both run on the CPU)."""

from __future__ import annotations

import json

import pytest

from loong_models import load_model_config
from loong_parallel import LanguageModel, ParallelConfig


def adaptive_model(tmp_path, tokens: int, *extra: str) -> LanguageModel:
    # fc1 wins from 8192 tokens, the other kinds never: the TP=4 sweep of llama3.1-8b on an H100
    rules = {"layernorm_column": {"qkv": [{"tp": 1, "min_tokens": None, "measured_speedup": 0.58}],
                                  "fc1": [{"tp": 1, "min_tokens": 8192, "measured_speedup": 1.15}]},
             "row": {"proj": [{"tp": 1, "min_tokens": None, "measured_speedup": 0.91}],
                     "fc2": [{"tp": 1, "min_tokens": None, "measured_speedup": 0.95}]}}  # fmt: skip
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"gpu_name": "NVIDIA H100 80GB HBM3", "te_version": "2.20.2",
                                "recipe": "tensorwise", "rules": rules}))  # fmt: skip
    cfg = load_model_config("tiny", ["+foundation.precision.fp8=adaptive", "+foundation.precision.recipe=tensorwise",
                                     f"+foundation.precision.policy={path}", *extra])  # fmt: skip
    return LanguageModel(cfg, backend="te", tokens_per_microbatch=tokens)


def test_adaptive_fp8_that_wins_nowhere_is_the_bf16_default_model_op_fuser_mlp_included(tmp_path):
    fused_mlp, precision = adaptive_model(tmp_path, 1024).mlp_and_precision(ParallelConfig())
    assert precision == {} and fused_mlp
    bf16 = LanguageModel(load_model_config("tiny"), backend="te", tokens_per_microbatch=1024)
    assert bf16.mlp_and_precision(ParallelConfig()) == (fused_mlp, precision)


def test_adaptive_fp8_that_wins_somewhere_keeps_megatrons_mlp_for_the_per_module_decisions(tmp_path):
    fused_mlp, precision = adaptive_model(tmp_path, 8192).mlp_and_precision(ParallelConfig())
    assert precision["fp8_recipe"] == "tensorwise" and "quant_recipe" in precision
    assert not fused_mlp


@pytest.mark.parametrize("tokens", [1024, 8192])
def test_an_explicit_fused_mlp_false_is_kept_whatever_the_policy_decides(tmp_path, tokens):
    fused_mlp, _ = adaptive_model(tmp_path, tokens, "+fused_mlp=false").mlp_and_precision(ParallelConfig())
    assert not fused_mlp
