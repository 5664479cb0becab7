"""GPU: LoRA on Transformer Engine's linears (layer_backend=te, fp32, TP=1) against plain torch.

Run on a CUDA machine with TE: ``pytest -m gpu packages/loong-models/tests/test_lora_gpu.py``.
``TELayerNormColumnParallelLinear`` (Q/K/V and fc1, norm fused in) must feed the adapter the
normalised input, the other TE linears their input; zero-init adapters leave the model unchanged.
"""

from __future__ import annotations

import pytest
import torch

from loong_models import FoundationConfig, LoraConfig, ModelConfig, build_model, build_transformer_config
from loong_models.specs import te_installed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not te_installed(), reason="needs transformer-engine"),
]


def _build(lora: LoraConfig | None, backend: str = "te"):
    torch.manual_seed(0)
    f = FoundationConfig(family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                         num_query_groups=2, vocab_size=256, max_position_embeddings=64)  # fmt: skip
    config = build_transformer_config(f, params_dtype=torch.float32, use_cpu_initialization=True,
                                      calculate_per_token_loss=True)  # fmt: skip
    return build_model(
        ModelConfig(foundation=f, layer_backend=backend, lora=lora), config, device_type="cuda"
    ).cuda()


@pytest.mark.parametrize("target", ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
def test_te_lora_linear_equals_plain_torch(megatron_cuda, target):
    model = _build(LoraConfig(rank=4, alpha=8.0))
    module = dict(model.named_modules())[
        f"decoder.layers.0.{'mlp' if 'fc' in target else 'self_attention'}.{target}"
    ]
    assert type(module).__name__.startswith("LoraTE")
    fused_norm = hasattr(module, "layer_norm_weight")
    x = torch.randn(8, 2, module.lora_a.shape[1], device="cuda", requires_grad=True)
    with torch.no_grad():  # the base layer alone (zero B), before `out` saves B for its backward
        module.lora_b.zero_()
        base_out, _ = module(x)
        module.lora_b.normal_()
    out, _ = module(x)
    inp = x.detach()
    if fused_norm:  # RMSNorm with the layer's fused norm weight
        inp = (
            inp
            * torch.rsqrt(inp.pow(2).mean(-1, keepdim=True) + module.eps)
            * module.layer_norm_weight.detach()
        )
    a = module.lora_a.detach().clone().requires_grad_(True)
    b = module.lora_b.detach().clone().requires_grad_(True)
    delta = (inp @ a.T @ b.T) * 2.0
    torch.testing.assert_close(out, base_out + delta, rtol=1e-4, atol=1e-4)

    g = torch.randn_like(out)
    out.backward(g)
    delta.backward(g)
    torch.testing.assert_close(module.lora_a.grad, a.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(module.lora_b.grad, b.grad, rtol=1e-4, atol=1e-4)


def test_te_zero_init_adapters_keep_the_model(megatron_cuda):
    base, lora = _build(None), _build(LoraConfig(rank=4))
    tokens = torch.randint(0, 256, (2, 16), device="cuda")
    pos = torch.arange(16, device="cuda").expand(2, -1)
    with torch.no_grad():
        torch.testing.assert_close(lora(tokens, pos, None), base(tokens, pos, None), rtol=0, atol=0)
    assert {n for n, p in lora.named_parameters() if p.requires_grad} == {
        n for n, _ in lora.named_parameters() if n.endswith(("lora_a", "lora_b"))
    }
