"""model.<component>.precision: its validation, adaptive-FP8 policy files, the threshold rule,
the decision per module, and the megatron quantisation config it becomes (all on the CPU: the
policy is data, the decision a pure function, and megatron's RecipeConfig matches module paths
without TE)."""

import json
import logging

import pytest
from megatron.core.quantization.utils import get_quant_config_or_none

from loong_models import (
    FoundationConfig,
    ModelConfig,
    build_model,
    build_transformer_config,
    load_model_config,
)
from loong_models.precision import (
    FP8Recipe,
    PrecisionConfig,
    check_policy_environment,
    decide,
    decide_modules,
    load_policy,
    min_winning_tokens,
    precision_fields,
)

H100 = "NVIDIA H100 80GB HBM3"


def policy_dict(**over) -> dict:
    rules = {"layernorm_column": {"qkv": [{"tp": 1, "min_tokens": 4096, "measured_speedup": 1.2},
                                          {"tp": 2, "min_tokens": 16384, "measured_speedup": 1.1}],
                                  "fc1": [{"tp": 1, "min_tokens": 1024, "measured_speedup": 1.4}]},
             "row": {"proj": [{"tp": 1, "min_tokens": None, "measured_speedup": 0.9}],
                     "fc2": [{"tp": 1, "min_tokens": 2048, "measured_speedup": 1.3}]},
             "column_grouped": {"expert_fc1": [{"tp": 1, "min_tokens": 4096, "measured_speedup": 1.2}]}}  # fmt: skip
    return {"gpu_name": H100, "te_version": "2.20.2", "recipe": "blockwise", "speedup_threshold": 1.02,
            "rules": rules, **over}  # fmt: skip


@pytest.fixture
def policy_file(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(policy_dict()))
    return path


@pytest.mark.parametrize(("settings", "error"), [
    (dict(fp8="adaptive"), r"model.foundation.precision.fp8=adaptive needs model.foundation.precision.policy"),
    (dict(fp8="on", policy="p.json"), r"model.foundation.precision.policy is only read with .*fp8=adaptive"),
    (dict(fp8="adaptive", recipe="delayed", policy="p.json"), r"model.foundation.precision.recipe=delayed cannot be adaptive"),
    (dict(fp8="on", num_tokens=0), r"model.foundation.precision.num_tokens=0 must be >= 1"),
    (dict(fp8="sometimes"), r"model.foundation.precision.fp8='sometimes'; allowed: off, on, adaptive"),
    (dict(fp8_output_layer=True), r"model.foundation.precision.fp8_output_layer=true needs model.foundation.precision.fp8=on"),
    (dict(fp8="on", fp8_output_layer=True), r"fp8_output_layer=true needs model.foundation.output_loss=fused"),
])  # fmt: skip
def test_contradicting_precision_settings_are_refused_naming_the_key(settings, error):
    with pytest.raises(ValueError, match=error):
        FoundationConfig(precision=PrecisionConfig(**settings)).validate()


def test_an_fp8_output_layer_with_the_fused_loss_is_accepted():
    FoundationConfig(output_loss="fused", precision=PrecisionConfig(fp8="on", fp8_output_layer=True)).validate()


def test_an_unknown_recipe_in_the_yaml_is_refused_with_the_allowed_values():
    with pytest.raises(Exception, match=r"(?s)Invalid value 'fp4'.*tensorwise.*foundation.precision.recipe"):
        load_model_config("tiny", ["+foundation.precision.recipe=fp4"])


def test_the_zoo_composes_a_precision_override():
    cfg = load_model_config("tiny", ["+foundation.precision.fp8=on", "+foundation.precision.recipe=blockwise"])
    assert (cfg.foundation.precision.fp8, cfg.foundation.precision.recipe) == ("on", "blockwise")


def test_the_threshold_is_where_every_larger_size_wins_not_the_first_crossing():
    sweep = [(512, 0.7), (1024, 1.05), (2048, 0.98), (4096, 1.03), (8192, 1.2), (16384, 1.3)]
    assert min_winning_tokens(sweep, 1.02) == 4096  # 1024 wins, but 2048 loses again
    assert min_winning_tokens(sweep, 1.0) == 4096
    assert min_winning_tokens(sweep[:3], 1.02) is None  # the largest measured size loses: never FP8
    assert min_winning_tokens([(4096, 1.5), (1024, 1.1)], 1.02) == 1024  # order of measurement is irrelevant


def test_a_policy_reads_the_same_from_json_and_yaml(tmp_path, policy_file):
    from omegaconf import OmegaConf

    yaml = tmp_path / "policy.yaml"
    OmegaConf.save(OmegaConf.create(policy_dict()), yaml)
    a, b = load_policy(policy_file), load_policy(yaml)
    assert a.rules == b.rules and a.recipe == b.recipe == "blockwise" and a.gpu_name == H100
    assert a.rule("qkv", 2).min_tokens == 16384 and a.rule("proj", 1).min_tokens is None
    assert a.rule("qkv", 4) is None


@pytest.mark.parametrize(("content", "error"), [
    ("{not json", r"not valid JSON"),
    (json.dumps({k: v for k, v in policy_dict().items() if k != "gpu_name"}), r"missing key 'gpu_name'"),
    (json.dumps(policy_dict(recipe="fp4")), r"recipe='fp4'; allowed: tensorwise, blockwise, delayed, mxfp8"),
    (json.dumps(policy_dict(rules={"row": {"fc2": [{"tp": 0, "min_tokens": 5}]}})), r"rules.row.fc2: tp=0 must be"),
    (json.dumps(policy_dict(rules={"row": {"fc2": [{"tp": 1}]}})), r"rules.row.fc2: each rule needs 'tp' and 'min_tokens'"),
    (json.dumps(policy_dict(rules={"row": {"fc2": [{"tp": 1, "min_tokens": -3}]}})), r"min_tokens=-3 must be"),
    (json.dumps(policy_dict(rules=[1])), r"rules must be a mapping"),
])  # fmt: skip
def test_a_bad_policy_file_is_refused_naming_the_file_and_key(tmp_path, content, error):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"FP8 policy {path}.*{error}"):
        load_policy(path)


def test_a_missing_policy_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=rf"FP8 policy {tmp_path}/nope.json: no such file"):
        load_policy(tmp_path / "nope.json")


def test_a_policy_for_another_gpu_or_recipe_is_refused_and_another_te_version_warned(policy_file):
    policy, key = load_policy(policy_file), "model.foundation.precision"
    with pytest.raises(ValueError, match=rf"{key}.policy={policy_file} was measured on '{H100}', this run is on 'NVIDIA H200'"):
        check_policy_environment(policy, recipe=FP8Recipe.blockwise, gpu_name="NVIDIA H200", te_version="2.20.2", prefix=key)
    with pytest.raises(ValueError, match=rf"{key}.policy={policy_file} was measured for recipe 'blockwise' but {key}.recipe=tensorwise"):
        check_policy_environment(policy, recipe=FP8Recipe.tensorwise, gpu_name=H100, te_version="2.20.2", prefix=key)
    assert check_policy_environment(policy, recipe=FP8Recipe.blockwise, gpu_name=H100, te_version="2.20.2", prefix=key) == []
    (warning,) = check_policy_environment(policy, recipe=FP8Recipe.blockwise, gpu_name=H100, te_version="2.9.0", prefix=key)
    assert f"{policy_file} was measured with transformer-engine 2.20.2, this run has 2.9.0" in warning  # fmt: skip


def test_the_decision_follows_the_threshold_for_the_tp_size_and_tokens(policy_file):
    p = load_policy(policy_file)
    assert decide(p, "qkv", tp=1, tokens=4096).fp8 and not decide(p, "qkv", tp=1, tokens=4095).fp8
    assert not decide(p, "qkv", tp=2, tokens=8192).fp8 and decide(p, "qkv", tp=2, tokens=16384).fp8
    assert not decide(p, "proj", tp=1, tokens=10**6).fp8  # never won in the sweep
    missing = decide(p, "qkv", tp=8, tokens=10**6)
    assert not missing.fp8 and "no rule for tp=8" in missing.reason
    # routed experts see tokens x top-k rows in their grouped GEMM
    assert decide(p, "expert_fc1", tp=1, tokens=1024, router_topk=4).fp8
    assert not decide(p, "expert_fc1", tp=1, tokens=1024, router_topk=2).fp8


def tiny_llama(**kw) -> FoundationConfig:
    return FoundationConfig(family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                            num_query_groups=2, vocab_size=200, max_position_embeddings=64, **kw)  # fmt: skip


def module_paths(model) -> list[str]:
    """Every linear: the layers' projections, the output layer, the MoE router."""
    return [n for n, m in model.named_modules() if n.rsplit(".", 1)[-1].startswith(("linear_", "output_layer", "router"))]


@pytest.mark.parametrize(("name", "tokens", "fp8_kinds"), [
    ("llama", 2048, {"fc1", "fc2"}),
    ("llama", 4096, {"qkv", "fc1", "fc2"}),
    ("qwen3-moe-tiny", 2048, {"expert_fc1"}),  # the experts see 2048 x top-2 = 4096 rows: FP8; qkv (2048) not
])  # fmt: skip
def test_each_built_module_resolves_to_the_decided_precision_through_megatrons_matchers(
    megatron_cpu, policy_file, name, tokens, fp8_kinds
):
    f = tiny_llama() if name == "llama" else load_model_config(name).foundation
    f.precision = PrecisionConfig(fp8="adaptive", recipe="blockwise", policy=str(policy_file))
    fields = precision_fields(f.precision, load_policy(policy_file), gemms=f.gemm_kinds(), tp=1, tokens=tokens,
                              router_topk=f.moe.router_topk if f.moe else 1, prefix="model.foundation")  # fmt: skip
    assert fields["fp8"] == "e4m3" and fields["fp8_recipe"] == "blockwise"
    # megatron refuses fp8 for MoE without TE installed, so only the per-module recipe goes in here
    config = build_transformer_config(f, use_cpu_initialization=True, quant_recipe=fields["quant_recipe"])
    model = build_model(ModelConfig(foundation=f, layer_backend="local"), config, device_type="cpu")
    paths = module_paths(model)
    decisions = decide_modules(load_policy(policy_file), paths, tp=1, tokens=tokens,
                               router_topk=f.moe.router_topk if f.moe else 1)  # fmt: skip
    seen = set()
    for path in paths:
        quant = get_quant_config_or_none(path, config.quant_recipe).config["training_recipe"]
        d = decisions[path]
        expect_fp8 = d is not None and d.fp8
        assert (quant == {"fp8_quantization_recipe": "blockwise"}) == expect_fp8, path
        assert expect_fp8 == (d is not None and d.gemm in fp8_kinds), path
        seen.add(d.gemm if d else None)
    assert None in seen  # the output layer: no GEMM kind, so BF16 (the catch-all matcher)
    assert fp8_kinds <= seen


def test_fp8_on_sets_megatrons_global_recipe_without_per_module_overrides():
    fields = precision_fields(PrecisionConfig(fp8="on", recipe="delayed"), None, gemms=["qkv"], tp=1, tokens=8,
                              prefix="model.foundation")  # fmt: skip
    assert fields["fp8"] == "hybrid" and fields["fp8_recipe"] == "delayed" and "quant_recipe" not in fields
    assert precision_fields(PrecisionConfig(), None, gemms=["qkv"], tp=1, tokens=8, prefix="m") == {}


def test_adaptive_where_fp8_wins_nowhere_is_plain_bf16_without_megatrons_fp8_recipe(policy_file, caplog):
    caplog.set_level(logging.INFO, logger="loong_models")
    pcfg = PrecisionConfig(fp8="adaptive", recipe="blockwise", policy=str(policy_file))
    policy = load_policy(policy_file)
    # 512 tokens: below every threshold of the policy (fc1 wins from 1024)
    assert precision_fields(pcfg, policy, gemms=["qkv", "proj", "fc1", "fc2"], tp=1, tokens=512, prefix="m") == {}
    assert "m.precision: FP8 wins for no GEMM kind at these shapes: the component runs in BF16" in caplog.text
    assert "adaptive FP8 at tp=1" in caplog.text  # the decision table still says why
    one_wins = precision_fields(pcfg, policy, gemms=["qkv", "proj", "fc1", "fc2"], tp=1, tokens=1024, prefix="m")
    assert one_wins["fp8_recipe"] == "blockwise" and "quant_recipe" in one_wins


def test_the_decision_table_is_logged_with_each_gemm_kind(policy_file, caplog):
    caplog.set_level(logging.INFO, logger="loong_models")
    pcfg = PrecisionConfig(fp8="adaptive", recipe="blockwise", policy=str(policy_file))
    precision_fields(pcfg, load_policy(policy_file), gemms=["qkv", "proj", "fc1", "fc2"], tp=2, tokens=16384,
                     prefix="model.foundation")  # fmt: skip
    table = caplog.text
    assert "model.foundation.precision: adaptive FP8 at tp=2" in table
    assert "qkv" in table and ">= 16384 tokens" in table
    assert "has no rule for GEMM kinds ['proj', 'fc1', 'fc2'] at tp=2" in table


def test_the_foundation_lists_the_gemm_kinds_of_its_layers():
    assert tiny_llama().gemm_kinds() == ["qkv", "proj", "fc1", "fc2"]
    moe = load_model_config("qwen3-moe-tiny").foundation
    assert {"expert_fc1", "expert_fc2"} <= set(moe.gemm_kinds())
    dsv3 = load_model_config("deepseek-v3-tiny").foundation
    assert {"q_down_proj", "kv_down_proj", "kv_up_proj", "proj"} <= set(dsv3.gemm_kinds())
