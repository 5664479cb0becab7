"""The CPU side of bench/fp8_policy.py: the model's GEMM shapes per TP size, and the policy its
measurements become (synthetic timings; the GPU sweep itself needs CUDA and TE)."""

from pathlib import Path

import pytest

from loong_models import load_model_config
from loong_models.precision import decide, load_policy, write_policy
from loong_train.testing import load_script

_PATH = Path(__file__).parents[1] / "bench" / "fp8_policy.py"
bench = load_script(_PATH)


def test_the_swept_shapes_are_one_tp_ranks_linears_of_the_model():
    f = load_model_config("llama3.2-1b").foundation  # h 2048, 32 heads, 8 KV groups of 64, ffn 8192
    shapes = {g.kind: (g.in_features, g.out_features, g.with_norm) for g in bench.gemm_shapes(f, 1)}
    assert shapes == {"qkv": (2048, 3072, True), "proj": (2048, 2048, False), "fc1": (2048, 16384, True),
                      "fc2": (8192, 2048, False)}  # fmt: skip
    shapes4 = {g.kind: (g.in_features, g.out_features) for g in bench.gemm_shapes(f, 4)}
    assert shapes4 == {"qkv": (2048, 768), "proj": (512, 2048), "fc1": (2048, 4096), "fc2": (2048, 2048)}
    with pytest.raises(SystemExit, match="--tp 3 does not divide the model's heads"):
        bench.gemm_shapes(f, 3)


def test_synthetic_timings_become_thresholds_where_every_larger_size_wins(tmp_path):
    # (tokens, bf16 ms, fp8 ms): qkv wins at 1024, loses at 2048, wins from 4096 on; proj never wins
    sweep = {"qkv": {1: [(1024, 1.0, 0.9), (2048, 2.0, 2.1), (4096, 4.0, 3.0), (8192, 8.0, 5.0)],
                     2: [(1024, 0.5, 0.6), (2048, 1.0, 0.99), (4096, 2.0, 1.9), (8192, 4.0, 3.0)]},
             "proj": {1: [(1024, 1.0, 1.5), (8192, 8.0, 8.5)]},
             "fc2": {1: [(4096, 3.0, 2.0), (1024, 1.0, 0.5)]}}  # fmt: skip
    policy = bench.policy_from_sweep(sweep, threshold=1.02, gpu_name="NVIDIA H100 80GB HBM3", te_version="2.20.2",
                                     recipe="blockwise")  # fmt: skip
    assert policy.rule("qkv", 1).min_tokens == 4096  # not 1024: 2048 loses again
    assert policy.rule("qkv", 2).min_tokens == 4096  # 2048 wins by 1.01x only: below the 1.02 threshold
    assert policy.rule("proj", 1).min_tokens is None
    assert policy.rule("fc2", 1).min_tokens == 1024
    assert policy.rule("qkv", 1).measured_speedup == 1.6  # at the largest size
    assert set(policy.rules) == {"layernorm_column", "row"}
    write_policy(policy, tmp_path / "p.json")
    again = load_policy(tmp_path / "p.json")
    assert again.rules == policy.rules and again.recipe == "blockwise"
    assert decide(again, "qkv", tp=1, tokens=8192).fp8 and not decide(again, "qkv", tp=1, tokens=2048).fp8


def test_bad_arguments_are_refused():
    assert bench.parse_args([]).recipe == "blockwise"
    with pytest.raises(SystemExit):
        bench.parse_args(["--recipe", "fp4"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--tp", "0"])
