"""RouterStats on a real megatron MoE model (one process, gloo): every routed token is counted
once per MoE layer, also when the MoE layer is recomputed for its backward, and never in
evaluation; megatron's tracked aux loss comes back as a number."""

import pytest
import torch

from loong_models import ModelConfig, build_model, build_transformer_config, load_model_config
from loong_parallel import RouterStats


def build(recompute_modules=None):
    f = load_model_config("qwen3-moe-tiny").foundation
    if recompute_modules:
        f.recompute, f.recompute_modules = "selective", recompute_modules
    config = build_transformer_config(f, use_cpu_initialization=True, calculate_per_token_loss=True,
                                      moe_token_dispatcher_type="alltoall")  # fmt: skip
    return f, config, build_model(ModelConfig(foundation=f, layer_backend="local"), config, device_type="cpu")


@pytest.mark.parametrize("recompute", [None, ["moe"]], ids=["plain", "recompute-moe"])
def test_tokens_per_expert_count_each_routed_token_once(megatron_cpu, recompute):
    f, config, model = build(recompute)
    stats = RouterStats([model], config, torch.device("cpu"))
    tokens = torch.randint(0, f.vocab_size, (2, 16))
    pos = torch.arange(16).expand(2, -1)
    for _ in range(2):  # two micro-batches
        model(tokens, pos, None, labels=tokens).sum().backward()
    with torch.no_grad():  # evaluation is not counted
        model(tokens, pos, None, labels=tokens)
    out = stats.report(microbatches=2, step=1)
    counts = out["moe_tokens_per_expert"]
    assert len(counts) == 8 and sum(counts) == 2 * 32 * f.moe.router_topk * f.num_layers
    assert out["moe_load_imbalance_max"] >= out["moe_load_imbalance"] >= 1.0
    assert 0.5 < out["moe_load_balancing_loss"] < 4.0  # Switch-style loss: 1.0 when uniform
    assert stats.report(microbatches=1, step=2) == {"moe_load_balancing_loss": 0.0}  # nothing since
    stats.close()


def test_ep_load_imbalance_is_the_busiest_ranks_share_over_the_mean_per_layer():
    from loong_parallel.moe import ep_load_imbalance

    # 8 experts on 2 EP ranks (experts 0-3 and 4-7): layer 1 puts 30 of 40 tokens on rank 0 (1.5),
    # layer 2 splits them evenly (1.0) although its experts are far from balanced
    counts = torch.tensor([[10.0, 10, 5, 5, 2, 2, 3, 3], [20, 0, 0, 0, 0, 0, 0, 20]], dtype=torch.float64)
    assert ep_load_imbalance(counts, ep=2).tolist() == pytest.approx([1.5, 1.0])
    assert ep_load_imbalance(counts, ep=8).tolist() == pytest.approx([10 / 5, 20 / 5])
    assert ep_load_imbalance(counts, ep=1).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="8 experts do not split over ep=3"):
        ep_load_imbalance(counts, ep=3)
