"""GPU: the FP8 linear + cross-entropy (cuBLASLt FP8 GEMMs around the TileLang softmax kernel)
against its float32 emulation, its cast-transpose kernel bit for bit against torch's casts, and
its time against the bf16 fused loss at the shape of an 8B model's output layer (8192 tokens,
hidden 4096, vocab 128256).

Run with ``pytest -m gpu packages/loong-kernels`` on a GPU with FP8 tensor cores (sm_89+).
"""

import pytest
import torch

import loong_kernels as lk
from loong_kernels import dispatch, use_implementation
from loong_kernels.reference.fp8 import E4M3, E5M2, cast_transpose, pow2_scale
from loong_kernels.reference.linear_cross_entropy_fp8 import linear_cross_entropy_tokens_fp8_chunked
from loong_kernels.tilelang_support import tilelang_importable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores"
    ),
    pytest.mark.skipif(not tilelang_importable(), reason="needs tilelang"),
]
BF16 = torch.bfloat16


def _data(n, dim, vocab, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, dim, device="cuda", dtype=BF16, generator=g) * 2
    w = torch.randn(vocab, dim, device="cuda", dtype=BF16, generator=g) * (3 / dim**0.5)
    t = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    weight = torch.ones(n, device="cuda")
    weight[::7] = 0
    return h, w, t, weight / weight.sum()


def _fused(h, w, t, weight, fp8):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    losses = lk.linear_cross_entropy_per_token(hh, ww, t, weight, fp8=fp8)
    (losses * weight).sum().backward()
    return losses.detach(), hh.grad, ww.grad


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_the_cast_transpose_kernel_is_torchs_cast_bit_for_bit(fmt):
    from loong_kernels.tl.linear_cross_entropy_fp8 import tilelang_cast_transpose

    x = torch.randn(1000, 4160, device="cuda", dtype=BF16) * 40  # neither side a multiple of the 64 tile
    for scale in (pow2_scale(x.abs().amax(), fmt), torch.tensor(3.7e2 / x.abs().amax().item(), device="cuda")):
        got, got_t = tilelang_cast_transpose(x, scale, fmt)
        want, want_t = cast_transpose(x, scale, fmt)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got_t.view(torch.uint8), want_t.view(torch.uint8))


@pytest.mark.parametrize(("n", "dim", "vocab", "chunk"), [(1000, 256, 5120, 256), (777, 512, 128256, None)])
def test_fp8_gemms_give_the_float32_emulation(n, dim, vocab, chunk):
    from loong_kernels.tl.linear_cross_entropy_fp8 import linear_cross_entropy_tokens_fp8

    h, w, t, weight = _data(n, dim, vocab)
    with use_implementation("tilelang"):
        got = lk.linear_cross_entropy_per_token(h, w, t, weight, chunk, fp8=True)  # loss only
    fast = linear_cross_entropy_tokens_fp8(h, w, t, weight, chunk, True, True)
    ref = linear_cross_entropy_tokens_fp8_chunked(h, w, t, weight, chunk, True, True)
    # both round the same products' sums to bf16 logits; another summation order can flip one
    # rounding: a token's loss may move by one bf16 step of its target logit
    step = 2.0 ** (torch.log2((h.float() @ w.float().t()).abs().max()).floor().item() - 7)
    for losses in (fast[0], got):
        assert (losses - ref[0]).abs().max() <= 1.01 * step
        torch.testing.assert_close((losses * weight).sum(), (ref[0] * weight).sum(), atol=2e-3, rtol=0)
    # a logit's flipped bf16 rounding can flip an E5M2 rounding of its gradient (steps 25% apart):
    # a few entries differ by a step (0.1% of them on an H100), the whole stays within 5%
    for a, b in zip(fast[1:], ref[1:], strict=True):
        a, b = a.float().flatten(), b.float().flatten()
        assert (a - b).norm() <= 5e-2 * b.norm()
        assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.999


def test_widths_that_cublaslt_fp8_gemms_cannot_take_run_the_emulation():
    h, w, t, weight = _data(64, 256, 5000)  # vocab not a multiple of 16
    assert dispatch.choose("linear_cross_entropy_tokens_fp8", h, w, t, weight, None, True, True) == "reference"
    losses = lk.linear_cross_entropy_per_token(h, w, t, weight, fp8=True)
    ref = linear_cross_entropy_tokens_fp8_chunked(h, w, t, weight, None, False, False)
    torch.testing.assert_close(losses, ref[0])


def _median_ms(fn, *args, reps=7):
    fn(*args)  # compiles the kernels
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def test_fp8_is_faster_than_the_bf16_fused_loss_at_an_8b_output_layer():
    h, w, t, weight = _data(8192, 4096, 128256)
    with use_implementation("tilelang"):
        bf16_ms = _median_ms(_fused, h, w, t, weight, False)
        fp8_ms = _median_ms(_fused, h, w, t, weight, True)
        bf16, fp8 = _fused(h, w, t, weight, False), _fused(h, w, t, weight, True)
    print(f"8192 x 4096 -> 128256, loss and both gradients: bf16 {bf16_ms:.2f} ms, fp8 {fp8_ms:.2f} ms "
          f"({bf16_ms / fp8_ms:.2f}x)")  # fmt: skip
    # the same loss (0.2% off on an H100 for these logits, std ~6) and gradient directions as bf16
    mean = (bf16[0] * weight).sum()
    assert ((fp8[0] - bf16[0]) * weight).sum().abs() < 5e-3 * mean
    for a, b in zip(fp8[1:], bf16[1:], strict=True):
        assert torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0) > 0.99
    assert fp8_ms < bf16_ms
