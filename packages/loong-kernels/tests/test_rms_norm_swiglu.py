"""RMSNorm and SwiGLU references against their formulas, and their autograd backward."""

import pytest
import torch
import torch.nn.functional as F

from loong_kernels import rms_norm, swiglu
from loong_kernels.ops.rms_norm import RMSNormFunction
from loong_kernels.ops.swiglu import SwiGLUFunction


def _rms_formula(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_formula_values_and_grads(with_residual):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 5, 16, dtype=torch.float64, requires_grad=True) if with_residual else None
    w = torch.randn(16, dtype=torch.float64, requires_grad=True)
    y, h = rms_norm(x, w, eps=1e-5, residual=r)
    h_ref = x + r if with_residual else x
    y_ref = _rms_formula(h_ref, w, 1e-5)
    torch.testing.assert_close(y, y_ref)
    # the new residual feeds the next add, so its gradient must reach x and r too
    loss = (y * torch.linspace(-1, 1, 16, dtype=torch.float64)).sum() + (h.pow(2).sum() if with_residual else 0)
    loss_ref = (y_ref * torch.linspace(-1, 1, 16, dtype=torch.float64)).sum() + (
        h_ref.pow(2).sum() if with_residual else 0
    )
    inputs = [x, w] + ([r] if with_residual else [])
    got = torch.autograd.grad(loss, inputs)
    want = torch.autograd.grad(loss_ref, inputs)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)
    assert (h is None) == (not with_residual)


def test_rms_norm_gradcheck():
    torch.manual_seed(1)
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    r = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: RMSNormFunction.apply(a, b, c, 1e-6), (x, w, r))
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFunction.apply(a, b, None, 1e-6)[0], (x, w))


def test_rms_norm_bf16_close_to_float64():
    torch.manual_seed(2)
    x = torch.randn(8, 64, dtype=torch.float64)
    w = torch.randn(64, dtype=torch.float64)
    y, _ = rms_norm(x.bfloat16(), w.bfloat16())
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), _rms_formula(x, w, 1e-6), atol=0.05, rtol=0.02)


def test_swiglu_matches_formula_values_and_grads():
    torch.manual_seed(3)
    x = torch.randn(2, 3, 10, dtype=torch.float64, requires_grad=True)
    y = swiglu(x)
    gate, up = x.chunk(2, -1)
    y_ref = F.silu(gate) * up
    torch.testing.assert_close(y, y_ref)
    dy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(y_ref, x, dy)[0])


def test_swiglu_gradcheck_and_odd_width_error():
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SwiGLUFunction.apply, (x,))
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(torch.randn(2, 7))
