"""Why real routing collapsed at random init in the MoE benches, and the zoo default that fixes it.

At hidden size 2048 with embeddings of std 0.02, the first attention's output dominates the
residual stream. Attention is near-uniform at init, so that output is a running mean of the
prefix's values: nearly the same vector for neighbouring tokens. The routers then see almost the
same input for every token and send them all to the same top-k experts (measured on qwen3-30b-a3b
cut to 2 layers: load imbalance 14.6 of at most 16 at layer 1). Embeddings of std 1.0 keep each
token's identity in front (imbalance 2.25).
"""

import pytest
import torch

from loong_models import ModelConfig, build_model, build_transformer_config, load_model_config

# qwen3-30b-a3b's width (what matters: hidden 2048, 32/4 heads), cut to 2 layers and few experts
CUT = ["foundation.num_layers=2", "foundation.moe.num_experts=16", "foundation.moe.router_topk=2",
       "foundation.moe.ffn_hidden_size=64", "foundation.vocab_size=4096"]  # fmt: skip


def router_input_common_fraction(overrides: list[str]) -> list[float]:
    """Per MoE layer: |mean over tokens of the router input| / mean |router input|, on random tokens.
    Near 0 when each token's router input is its own; near 1 when all tokens share one direction."""
    cfg = load_model_config("qwen3-30b-a3b", CUT + overrides)
    config = build_transformer_config(cfg.foundation, use_cpu_initialization=True)
    torch.manual_seed(0)
    model = build_model(ModelConfig(foundation=cfg.foundation, layer_backend="local"), config, device_type="cpu")
    fractions = []

    def record(module, args, output):
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        fractions.append(float(x.mean(0).norm() / x.norm(dim=1).mean()))

    routers = [m for m in model.modules() if type(m).__name__ == "TopKRouter"]
    for router in routers:
        router.register_forward_hook(record)
    tokens = torch.randint(0, 4096, (1, 256), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(tokens, torch.arange(256)[None], None)
    assert len(fractions) == len(routers) == 2
    return fractions


def test_moe_zoo_init_keeps_token_identity_in_the_router_input(megatron_cpu):
    assert load_model_config("qwen3-30b-a3b").foundation.embedding_init_std == 1.0
    assert load_model_config("deepseek-v3").foundation.embedding_init_std == 1.0
    collapsed = router_input_common_fraction(["foundation.embedding_init_std=0.02"])
    fixed = router_input_common_fraction([])
    assert min(collapsed) > 0.4 and collapsed[1] > 0.7, collapsed  # measured 0.505, 0.861
    assert max(fixed) < 0.2, fixed  # measured 0.083, 0.103


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["foundation.embedding_init_std=0"], r"embedding_init_std=0.0; expected > 0"),
        (["foundation.tie_word_embeddings=true"], r"embedding_init_std=1.0 with tie_word_embeddings=true"),
    ],
)
def test_embedding_init_std_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_model_config("qwen3-30b-a3b", overrides).foundation.validate()
