"""parallel.wgrad_fusion: TE linears accumulate their weight gradients straight into megatron's
fp32 main_grad. On a GPU the gradients equal the unfused path's (up to the bf16 rounding the unfused
path adds); on a model without TE linears the key is refused by name."""

from __future__ import annotations

import pytest
import torch

from loong_models import FoundationConfig, ModelConfig, build_model, build_transformer_config, fusion_fields
from loong_models.specs import te_installed
from loong_parallel import ParallelConfig, runtime_transformer_fields
from loong_parallel.model import build_model_chunks, fuse_wgrad_accumulation
from loong_xpu import get_accelerator
from loong_xpu.testing import megatron_world

F = FoundationConfig(family="llama", num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                     num_query_groups=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip


def test_wgrad_fusion_on_a_model_without_te_linears_is_refused_naming_the_key(megatron_cpu):
    config = build_transformer_config(F, use_cpu_initialization=True)
    model = build_model(ModelConfig(foundation=F, layer_backend="local"), config, device_type="cpu")
    with pytest.raises(ValueError, match=r"parallel.wgrad_fusion=true but the model has no TE linears"):
        fuse_wgrad_accumulation(model)


def main_grads(fusion: bool, accel) -> dict[str, torch.Tensor]:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    pcfg = ParallelConfig(wgrad_fusion=fusion)
    config = build_transformer_config(F, **runtime_transformer_fields(pcfg, dtype=torch.bfloat16, device_type="cuda"),
                                      **fusion_fields("te"))  # fmt: skip

    def provider(pre: bool, post: bool, vp: int | None) -> torch.nn.Module:
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0, force_reset_rng=True)
        return build_model(ModelConfig(foundation=F, layer_backend="te"), config, device_type="cuda")

    (chunk,) = build_model_chunks(provider, pcfg, config, accel)
    tokens = torch.randint(0, 256, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    pos = torch.arange(64, device="cuda").expand(2, -1)
    for _ in range(2):  # two micro-batches accumulate
        chunk(tokens, pos, None, labels=tokens).float().sum().backward()
    return {n: p.main_grad.clone() for n, p in chunk.module.named_parameters()
            if "linear_" in n and n.endswith(".weight") and "layer_norm" not in n}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not te_installed(), reason="needs CUDA and transformer-engine")
def test_fused_wgrad_accumulation_gives_the_unfused_gradients():
    accel = get_accelerator("cuda")
    with megatron_world(accel):
        unfused, fused = main_grads(False, accel), main_grads(True, accel)
    assert unfused.keys() == fused.keys() and len(fused) == 8  # qkv, proj, fc1, fc2 of two layers
    for name, g in unfused.items():
        err = (fused[name] - g).norm() / g.norm()
        assert err < 1e-2, (name, err.item())
