"""The FP8 linear + cross-entropy without a GPU: its power-of-two scaling, its float32 reference
against the bf16 formula, and its chunk loop (real FP8 GEMMs, torch._scaled_mm on the CPU, around
a torch emulation of the TileLang softmax kernel) against the reference."""

import pytest
import torch
import torch.nn.functional as F

from loong_kernels import dispatch, linear_cross_entropy_per_token
from loong_kernels.reference.fp8 import E4M3, E5M2, cast_transpose, pow2_scale, quantize
from loong_kernels.reference.linear_cross_entropy_fp8 import linear_cross_entropy_tokens_fp8_chunked
from loong_kernels.testing import emulated_ce_kernel
from loong_kernels.tilelang_support import tilelang_importable


def _data(n=300, dim=64, vocab=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, dim, generator=g) * 2).to(torch.bfloat16)
    w = (torch.randn(vocab, dim, generator=g) * 0.05).to(torch.bfloat16)
    t = torch.randint(0, vocab, (n,), generator=g)
    weight = torch.ones(n)
    weight[::7] = 0  # loss-masked tokens
    t[::11] = -100  # no target logit (megatron's convention); weight 0 too
    weight[::11] = 0
    return h, w, t, weight / weight.sum()


def _bf16_formula(h, w, t, weight):
    hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
    logits = hh @ ww.t()
    losses = torch.logsumexp(logits, -1) - torch.where(t >= 0, logits.gather(1, t.clamp(min=0)[:, None]).squeeze(1), 0)
    (losses * weight).sum().backward()
    return losses.detach(), hh.grad, ww.grad


def test_power_of_two_scales_fill_the_format_without_overflow():
    for amax in (1e-8, 0.3, 1.0, 448.0, 3e4):
        s = pow2_scale(torch.tensor(amax), E4M3)
        assert 224 < amax * s.item() <= 448 and torch.log2(s).item().is_integer()
    assert pow2_scale(torch.tensor(0.0), E5M2).item() == 1.0
    x = torch.randn(37, 53).to(torch.bfloat16) * 1000
    s = pow2_scale(x.abs().amax(), E5M2)
    q, qt = cast_transpose(x, s, E5M2)
    assert q.dtype == E5M2 and torch.isfinite(q.float()).all() and torch.equal(qt.float(), q.float().t())
    # one rounding of the exact product: dequantised values are within half an E5M2 step
    err = (q.float() / s - x.float()).abs()
    assert (err <= x.float().abs() * 2**-3 + 1e-30).all()
    assert torch.equal(quantize(x, s, E5M2).float(), q.float())


def test_the_fp8_reference_is_the_bf16_formula_within_fp8_rounding():
    h, w, t, weight = _data()
    losses, dh, dw = linear_cross_entropy_tokens_fp8_chunked(h, w, t, weight, 128, True, True)
    want = _bf16_formula(h, w, t, weight)
    # E4M3 logits (3 mantissa bits in both factors): tokens differ by up to ~0.1, the mean far less
    assert (losses - want[0]).abs().max() < 0.15
    torch.testing.assert_close((losses * weight).sum(), (want[0] * weight).sum(), atol=5e-3, rtol=0)
    for got, ref in ((dh, want[1]), (dw, want[2])):
        cos = F.cosine_similarity(got.float().flatten(), ref.flatten(), dim=0)
        assert cos > 0.999, cos
        # the gradient's scale puts the targets' entries on an E5M2 value: no shrink of the whole gradient
        torch.testing.assert_close(got.float().norm(), ref.norm(), rtol=1e-2, atol=0)


@pytest.mark.skipif(not tilelang_importable(), reason="the kernel module imports tilelang")
@pytest.mark.parametrize(("n", "chunk"), [(300, 128), (300, None), (45, 32), (0, None)])
def test_the_chunk_loop_with_fp8_gemms_matches_the_reference(n, chunk):
    from loong_kernels.tl.linear_cross_entropy_fp8 import chunked_tokens_fp8_with

    h, w, t, weight = _data(n=max(n, 1))
    h, t, weight = h[:n], t[:n], weight[:n]
    got = chunked_tokens_fp8_with(emulated_ce_kernel(True), cast_transpose, h, w, t, weight, chunk, True, True)
    want = linear_cross_entropy_tokens_fp8_chunked(h, w, t, weight, chunk, True, True)
    assert got[0].shape == (n,) and got[1].shape == h.shape and got[2].shape == w.shape
    torch.testing.assert_close(got[0], want[0], atol=2e-3, rtol=1e-3)
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2 * (b.abs().max().item() if b.numel() else 0) + 1e-12, rtol=0)
    losses_only = chunked_tokens_fp8_with(emulated_ce_kernel(False), cast_transpose, h, w, t, weight, chunk, False, False)
    assert losses_only[1] is None and losses_only[2] is None
    torch.testing.assert_close(losses_only[0], got[0])


def test_fp8_per_token_losses_train_through_autograd_on_the_cpu_with_the_reference():
    h, w, t, weight = _data(n=64)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    losses = linear_cross_entropy_per_token(hh, ww, t, weight, fp8=True)
    (losses * weight).sum().mul(3.0).backward()
    ref = linear_cross_entropy_tokens_fp8_chunked(h, w, t, weight, None, True, True)
    torch.testing.assert_close(losses, ref[0])
    torch.testing.assert_close(hh.grad.float(), 3 * ref[1].float(), rtol=1e-2, atol=1e-6)
    torch.testing.assert_close(ww.grad.float(), 3 * ref[2].float(), rtol=1e-2, atol=1e-6)
    assert dispatch.choose("linear_cross_entropy_tokens_fp8", h, w, t, weight, None, True, True) == "reference"
