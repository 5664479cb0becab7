"""Per-module FP8 decisions from a policy, and the megatron fields that apply them.

Each TE linear of a megatron GPT model has a module path (``decoder.layers.3.mlp.linear_fc1``);
its GEMM kind comes from the path (:data:`GEMM_KINDS`), its shape from the layout. Adaptive FP8
is a megatron ``RecipeConfig`` (``TransformerConfig.quant_recipe``): modules of the kinds that win
get the FP8 recipe, every other TE linear an empty recipe, which megatron runs in BF16."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from loong_models.log import logger
from loong_models.precision.config import FP8Mode, FP8Recipe, PrecisionConfig
from loong_models.precision.policy import Fp8Policy

# GEMM kind -> glob on the module path, in matching order (the names LoongForge's policies use).
GEMM_KINDS: dict[str, str] = {
    "qkv": "*self_attention.linear_qkv",
    "proj": "*self_attention.linear_proj",
    "q_proj": "*self_attention.linear_q_proj",
    "q_down_proj": "*self_attention.linear_q_down_proj",
    "q_up_proj": "*self_attention.linear_q_up_proj",
    "kv_down_proj": "*self_attention.linear_kv_down_proj",
    "kv_up_proj": "*self_attention.linear_kv_up_proj",
    "fc1": "*mlp.linear_fc1",
    "fc2": "*mlp.linear_fc2",
    "shared_fc1": "*mlp.shared_experts.linear_fc1",
    "shared_fc2": "*mlp.shared_experts.linear_fc2",
    "expert_fc1": "*mlp.experts.*linear_fc1",  # TE grouped experts, or each local expert
    "expert_fc2": "*mlp.experts.*linear_fc2",
}
# Routed experts see every token top-k times in one grouped GEMM.
_ROUTED = ("expert_fc1", "expert_fc2")
_TE_TYPE_KEY = "transformer_engine_config_type"  # megatron.core.extensions.transformer_engine's key


@dataclass(frozen=True)
class Decision:
    gemm: str
    tokens: int
    fp8: bool
    reason: str  # why: the rule's threshold, or that the policy has none
    measured_speedup: float | None


def gemm_kind(module_path: str) -> str | None:
    for kind, pattern in GEMM_KINDS.items():
        if fnmatch.fnmatch(module_path, pattern):
            return kind
    return None


def decide(policy: Fp8Policy, gemm: str, *, tp: int, tokens: int, router_topk: int = 1) -> Decision:
    """FP8 when the policy's rule for (``gemm``, ``tp``) has a threshold at or below the GEMM's
    token count (``tokens`` x ``router_topk`` for routed experts); BF16 otherwise."""
    n = tokens * router_topk if gemm in _ROUTED else tokens
    rule = policy.rule(gemm, tp)
    if rule is None:
        return Decision(gemm, n, False, f"no rule for tp={tp} in {policy.path}", None)
    if rule.min_tokens is None:
        return Decision(gemm, n, False, "FP8 never won in the sweep", rule.measured_speedup)
    wins = n >= rule.min_tokens
    return Decision(gemm, n, wins, f"{'>=' if wins else '<'} {rule.min_tokens} tokens", rule.measured_speedup)


def decide_modules(policy: Fp8Policy, module_paths: list[str], *, tp: int, tokens: int, router_topk: int = 1
                   ) -> dict[str, Decision | None]:  # fmt: skip
    """Each path's decision; None for a path of no known GEMM kind (it runs in BF16)."""
    out = {}
    for path in module_paths:
        kind = gemm_kind(path)
        out[path] = None if kind is None else decide(policy, kind, tp=tp, tokens=tokens, router_topk=router_topk)
    return out


def quant_recipe_dict(decisions: dict[str, Decision], recipe: FP8Recipe) -> dict:
    """megatron's RecipeConfig in dict form: one glob matcher per GEMM kind, FP8 or BF16, then
    BF16 for every other TE linear (a GEMM kind the policy does not know)."""
    te = "TEQuantizationParams"
    configs = {"fp8": {_TE_TYPE_KEY: te, "training_recipe": {"fp8_quantization_recipe": str(recipe)}},
               "bf16": {_TE_TYPE_KEY: te, "training_recipe": {}}}  # fmt: skip
    matchers = {kind: {"type": "glob", "enabled": True, "pattern": GEMM_KINDS[kind], "config": "fp8" if d.fp8 else "bf16"}
                for kind, d in decisions.items()}  # fmt: skip
    matchers["others"] = {"type": "glob", "enabled": True, "pattern": "*", "config": "bf16"}
    return {"configs": configs, "matchers": matchers}


def format_table(decisions: dict[str, Decision], *, tp: int, prefix: str) -> str:
    lines = [f"{prefix}.precision: adaptive FP8 at tp={tp}", f"  {'gemm':<13}{'tokens':>9}  {'decision':<6}"
             f"{'speedup':>9}  why"]  # fmt: skip
    for d in decisions.values():
        speedup = "-" if d.measured_speedup is None else f"{d.measured_speedup:.2f}x"
        lines.append(f"  {d.gemm:<13}{d.tokens:>9}  {'fp8' if d.fp8 else 'bf16':<6}{speedup:>9}  {d.reason}")
    return "\n".join(lines)


def precision_fields(pcfg: PrecisionConfig, policy: Fp8Policy | None, *, gemms: list[str], tp: int, tokens: int,
                     router_topk: int = 1, prefix: str) -> dict:  # fmt: skip
    """TransformerConfig fields for ``pcfg``: megatron's global FP8 recipe, and for adaptive the
    per-module ``quant_recipe`` (its decision table logged), or no FP8 field at all where the
    policy decides BF16 for every GEMM kind. ``gemms``: the model's GEMM kinds."""
    if pcfg.fp8 == FP8Mode.off:
        return {}
    from megatron.core.enums import Fp8Recipe

    # delayed scaling keeps E5M2 gradients (its usual "hybrid" format); the others are E4M3 throughout
    fields = dict(fp8="hybrid" if pcfg.recipe == FP8Recipe.delayed else "e4m3", fp8_recipe=Fp8Recipe(str(pcfg.recipe)))
    if pcfg.fp8 == FP8Mode.on:
        return fields
    from megatron.core.quantization.quant_config import RecipeConfig

    assert policy is not None
    decisions = {g: decide(policy, g, tp=tp, tokens=pcfg.num_tokens or tokens, router_topk=router_topk) for g in gemms}
    missing = [g for g, d in decisions.items() if d.measured_speedup is None]
    if missing:
        logger.warning("%s.precision.policy=%s has no rule for GEMM kinds %s at tp=%d: they run in BF16",
                       prefix, policy.path, missing, tp)  # fmt: skip
    logger.info(format_table(decisions, tp=tp, prefix=prefix))
    if not any(d.fp8 for d in decisions.values()):
        # no FP8 recipe at all rather than one that every module overrides: no FP8 autocast per
        # layer, so adaptive costs nothing where FP8 wins nowhere (small GEMMs, high TP)
        logger.info("%s.precision: FP8 wins for no GEMM kind at these shapes: the component runs in BF16", prefix)
        return {}
    return {**fields, "quant_recipe": RecipeConfig.from_config_dict(quant_recipe_dict(decisions, pcfg.recipe))}


def check_policy_environment(policy: Fp8Policy, *, recipe: FP8Recipe, gpu_name: str, te_version: str | None,
                             prefix: str) -> list[str]:  # fmt: skip
    """Raise naming the file when the policy was measured for another recipe or GPU; return
    warnings (another TE version: kernels change, thresholds may move)."""
    if policy.recipe != str(recipe):
        raise ValueError(f"{prefix}.policy={policy.path} was measured for recipe {policy.recipe!r} but "
                         f"{prefix}.recipe={recipe}; re-run bench/fp8_policy.py --recipe {recipe}")  # fmt: skip
    if policy.gpu_name != gpu_name:
        raise ValueError(f"{prefix}.policy={policy.path} was measured on {policy.gpu_name!r}, this run is on "
                         f"{gpu_name!r}; re-run bench/fp8_policy.py on this GPU")  # fmt: skip
    if te_version is not None and policy.te_version != te_version:
        return [f"{prefix}.policy={policy.path} was measured with transformer-engine {policy.te_version}, this "
                f"run has {te_version}: thresholds may have moved"]  # fmt: skip
    return []
