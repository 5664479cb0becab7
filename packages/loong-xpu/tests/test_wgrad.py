"""loong_xpu.wgrad: apex's fused_weight_gradient_mlp_cuda without apex (main_grad += dy^T @ x),
and the manifest entry that hands it to megatron-core's linears on every backend."""

import pytest
import torch

from loong_xpu import MANIFEST, apply_patches, get_accelerator
from loong_xpu.wgrad import wgrad_gemm_accum_fp16, wgrad_gemm_accum_fp32


def _operands(dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(24, 16, generator=g, device=device).to(dtype)  # [tokens, in]
    dy = torch.randn(24, 8, generator=g, device=device).to(dtype)  # [tokens, out]
    main_grad = torch.randn(8, 16, generator=g, device=device)  # [out, in], fp32
    return x, dy, main_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_wgrad_accumulates_the_unfused_product_into_main_grad(dtype):
    x, dy, main_grad = _operands(dtype)
    expected = main_grad + dy.t().float() @ x.float()
    wgrad_gemm_accum_fp32(x, dy, main_grad)
    torch.testing.assert_close(main_grad, expected, rtol=1e-6, atol=1e-6)


def test_a_bf16_main_grad_accumulates_too():
    x, dy, main_grad = _operands(torch.bfloat16)
    main_grad = main_grad.bfloat16()
    expected = (main_grad.float() + dy.t().float() @ x.float()).bfloat16()
    wgrad_gemm_accum_fp16(x, dy, main_grad)
    torch.testing.assert_close(main_grad, expected)


def test_megatron_linears_get_the_wgrad_gemms_on_every_backend_and_lose_them_after():
    from megatron.core.tensor_parallel import layers

    from loong_xpu import wgrad

    entry = next(p for p in MANIFEST if p.target.endswith(":fused_weight_gradient_mlp_cuda"))
    assert entry.on_cuda and "apex" in entry.reason
    had = hasattr(layers, "fused_weight_gradient_mlp_cuda")  # only where apex is installed
    patches = apply_patches(get_accelerator("cpu"))
    try:
        assert layers.fused_weight_gradient_mlp_cuda is wgrad
        nested = apply_patches(get_accelerator("cuda")) if torch.cuda.is_available() else None
        assert nested is None or nested.applied == []  # already supplied by the enclosing set
    finally:
        patches.remove()
    assert hasattr(layers, "fused_weight_gradient_mlp_cuda") == had


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fused_wgrad_on_cuda_matches_the_fp32_product():
    """TE's GEMM accumulating in place (or torch's where TE is not installed)."""
    x, dy, main_grad = _operands(torch.bfloat16, "cuda")
    expected = main_grad + dy.t().float() @ x.float()
    wgrad_gemm_accum_fp32(x, dy, main_grad)
    torch.testing.assert_close(main_grad, expected, rtol=1e-4, atol=1e-4)
