"""GPU: the DeepSeek-V3.2 attention layer (deepseek-v32-tiny sizes, bf16) with loong-kernels'
fused TileLang path against the same layer on the torch reference path.

Run on a CUDA machine: ``pytest -m gpu packages/loong-models/tests/test_dsa_gpu.py``. The fused
run forces ``use_implementation("tilelang")``, so a silent fallback cannot make it pass.

Tolerances are relative L2 errors, ``|fused - reference| / |reference|``: the references compute
in float32 from the same bf16 inputs, so what is left is bf16 rounding of the kernels' outputs
and a different float32 summation order (1e-2; bf16 has 8 mantissa bits, ~4e-3 per rounding).
With ``index_topk`` >= the sequence every key is selected on both paths; with a smaller top-k a
near-tie of indexer scores can select a different key on the two paths, so that case allows
5e-2.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.spec_utils import build_module

from loong_kernels import use_implementation
from loong_kernels.tilelang_support import tilelang_importable
from loong_models import build_transformer_config, decoder_block_spec, load_model_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not tilelang_importable(), reason="needs tilelang"),
]
S, B = 512, 2


def _attention(topk: int):
    # RoPE 32: TileLang's sparse-MLA kernels cannot split the 16-head x 16-wide tail GEMM over 4 warps
    f = load_model_config("deepseek-v32-tiny", ["foundation.mla.qk_pos_emb_head_dim=32"]).foundation
    f.sparse_attention.index_topk = topk
    config = build_transformer_config(
        f, params_dtype=torch.bfloat16, bf16=True, calculate_per_token_loss=True, use_cpu_initialization=True
    )
    spec = decoder_block_spec(config, backend="local").layer_specs[0].submodules.self_attention
    torch.manual_seed(0)
    return build_module(spec, config=config, layer_number=1).cuda(), config


def _run(attn, x: torch.Tensor, impl: str):
    attn.zero_grad(set_to_none=True)  # the same weights on both paths
    x = x.detach().clone().requires_grad_()
    with use_implementation(impl):
        out, _ = attn(x, None)
        weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
        (out.float() * weights).sum().backward()
    grads = {n: p.grad.float() for n, p in attn.named_parameters()}
    return out.float(), x.grad.float(), grads, attn.core_attention.indexer_loss


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("topk, tol", [(S, 1e-2), (64, 5e-2)], ids=["topk=seq", "topk=64"])
def test_fused_layer_matches_reference_layer(megatron_cuda, topk, tol):
    attn, config = _attention(topk)
    x = torch.randn(S, B, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    out, dx, grads, loss = _run(attn, x, "tilelang")
    ref_out, ref_dx, ref_grads, ref_loss = _run(attn, x, "reference")
    assert torch.isfinite(out).all() and torch.isfinite(dx).all()
    assert _rel(out, ref_out) <= tol, "output"
    assert _rel(dx, ref_dx) <= tol, "input gradient"
    for name, g in grads.items():  # main weights and the indexer's (through its KL loss)
        assert _rel(g, ref_grads[name]) <= tol, name
    assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss)), "indexer loss"
