"""Component precision: FP8 off / on / adaptive (per GEMM kind from a measured policy)."""

from loong_models.precision.config import FP8Mode, FP8Recipe, PrecisionConfig
from loong_models.precision.decide import (
    GEMM_KINDS,
    Decision,
    check_policy_environment,
    decide,
    decide_modules,
    gemm_kind,
    precision_fields,
    quant_recipe_dict,
)
from loong_models.precision.policy import Fp8Policy, Rule, load_policy, min_winning_tokens, write_policy

__all__ = [
    "GEMM_KINDS",
    "Decision",
    "FP8Mode",
    "FP8Recipe",
    "Fp8Policy",
    "PrecisionConfig",
    "Rule",
    "check_policy_environment",
    "decide",
    "decide_modules",
    "gemm_kind",
    "load_policy",
    "min_winning_tokens",
    "precision_fields",
    "quant_recipe_dict",
    "write_policy",
]
