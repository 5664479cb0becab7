"""bench/moe_routing_init.py on a tiny MoE model (CPU, one process): every routed token is counted
once per layer, for real text and for uniform tokens, and the imbalances are ratios >= 1."""

from pathlib import Path

import pytest

from loong_train.testing import load_script

_PATH = Path(__file__).parents[1] / "bench" / "moe_routing_init.py"
bench = load_script(_PATH)


def test_routing_at_init_reports_experts_and_ep_ranks_per_layer(capsys):
    results = bench.main(["--model", "qwen3-moe-tiny", "--layers", "2", "--seq", "128", "--ep", "2", "4"])
    assert set(results) == {"real text", "uniform tokens"}
    for rows in results.values():
        assert set(rows) == {"experts", "EP 2 ranks", "EP 4 ranks"}
        assert all(
            len(v) == 2 and all(1.0 <= x <= 8.0 for x in v) for v in rows.values()
        )  # 8 experts at most
        # a rank's share is a sum of its experts' shares: never further from the mean than the busiest expert
        assert all(r <= e + 1e-9 for r, e in zip(rows["EP 4 ranks"], rows["experts"], strict=True))
    assert "qwen3-moe-tiny x 2 layers, 8 experts top-2, one sequence of 128 tokens" in capsys.readouterr().out


def test_routed_counts_cover_every_token_topk_times():
    import torch

    from loong_models import ModelConfig, build_model, build_transformer_config, load_model_config
    from loong_xpu import get_accelerator
    from loong_xpu.testing import megatron_world

    cfg = load_model_config("qwen3-moe-tiny")
    tokens, _ = bench.text_tokens(64, seed=1)
    with megatron_world(get_accelerator("cpu")):
        config = build_transformer_config(cfg.foundation, use_cpu_initialization=True)
        model = build_model(
            ModelConfig(foundation=cfg.foundation, layer_backend="local"), config, device_type="cpu"
        )
        counts = bench.routed_counts(model, tokens, cfg.foundation.moe.num_experts)
    assert counts.shape == (cfg.foundation.num_layers, 8)
    assert torch.equal(
        counts.sum(1),
        torch.full((cfg.foundation.num_layers,), 64.0 * cfg.foundation.moe.router_topk, dtype=counts.dtype),
    )


def test_bad_arguments_name_the_flag():
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "qwen3-moe-tiny", "--ep", "3"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "llama3.2-1b"])
