"""GPU: the TileLang linear + cross-entropy against the float32 formula, its ignore_index handling,
its memory at the llama3.2-1b output layer, and the dispatcher's race against the chunked reference.

Run with ``pytest -m gpu packages/loong-kernels``. The logits and their gradient are bf16 in every
implementation (as in the unfused bf16 formula), so the tolerances are those of bf16 rounding.
"""

import pytest
import torch
import torch.nn.functional as F

import loong_kernels as lk
from loong_kernels import dispatch, use_implementation
from loong_kernels.reference import linear_cross_entropy_chunked, linear_cross_entropy_unfused
from loong_kernels.tilelang_support import tilelang_importable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not tilelang_importable(), reason="needs tilelang"),
]
BF16 = torch.bfloat16


def _data(n, dim, vocab, ignore=-100, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, dim, device="cuda", dtype=BF16, generator=g) * 0.5
    w = torch.randn(vocab, dim, device="cuda", dtype=BF16, generator=g) * (3 / dim**0.5)
    t = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    t[::7] = ignore
    return h, w, t


def _tilelang(h, w, t, ignore_index=-100, chunk_size=None, scale=1.0):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    with use_implementation("tilelang"):
        loss = lk.linear_cross_entropy(hh, ww, t, ignore_index=ignore_index, chunk_size=chunk_size)
    (loss * scale).backward()
    return loss.detach(), hh.grad, ww.grad


def _float32(h, w, t, ignore_index=-100):
    hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
    loss = F.cross_entropy(hh @ ww.t(), t, ignore_index=ignore_index)
    loss.backward()
    return loss.detach(), hh.grad, ww.grad


def _close(got, want, loss_tol=2e-2, grad_tol=2e-2):
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=loss_tol, rtol=loss_tol)
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=grad_tol * b.float().abs().max().item(), rtol=0)


# (tokens, dim, vocab, chunk): several chunks with a partial last one; a vocab below one kernel
# tile; llama's vocab (62 tiles and a tail) with the default chunk
@pytest.mark.parametrize(
    ("n", "dim", "vocab", "chunk"), [(1000, 256, 5000, 256), (300, 128, 1000, 128), (777, 512, 128256, None)]
)
def test_tilelang_matches_the_float32_formula(n, dim, vocab, chunk):
    h, w, t = _data(n, dim, vocab)
    got = _tilelang(h, w, t, chunk_size=chunk)
    _close(got, _float32(h, w, t))
    # the chunked bf16 reference computes the same bf16 logits: much closer
    want = linear_cross_entropy_chunked(h, w, t, -100, chunk, True, True)
    _close(got, want, loss_tol=1e-3, grad_tol=1e-2)


def test_tilelang_ignore_index_all_ignored_and_a_scaled_loss():
    h, w, t = _data(500, 256, 4096, ignore=7)
    _close(_tilelang(h, w, t, ignore_index=7, chunk_size=128), _float32(h, w, t, ignore_index=7))
    loss, dh, dw = _tilelang(h, w, torch.full_like(t, -100), chunk_size=128)
    assert loss.item() == 0.0 and dh.abs().max().item() == 0 and dw.abs().max().item() == 0
    once, thrice = _tilelang(h, w, t, ignore_index=7), _tilelang(h, w, t, ignore_index=7, scale=3.0)
    for a, b in zip(once[1:], thrice[1:], strict=True):
        torch.testing.assert_close(b.float(), 3 * a.float(), atol=1e-2 * b.float().abs().max().item(), rtol=0)


def _peak(fn, *args):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def test_tilelang_at_the_llama_output_layer_agrees_and_uses_a_fraction_of_the_unfused_memory():
    h, w, t = _data(8192, 2048, 128256)
    _tilelang(h, w, t)  # compiles the kernel outside the measurement
    got, fused_peak = _peak(_tilelang, h, w, t)

    def unfused(h, w, t):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy_unfused(hh, ww, t)
        loss.backward()
        return loss.detach(), hh.grad, ww.grad

    want, unfused_peak = _peak(unfused, h, w, t)
    _close(got, want, loss_tol=1e-3, grad_tol=1e-2)
    print(f"peak above inputs: tilelang {fused_peak / 2**20:.0f} MiB, unfused {unfused_peak / 2**20:.0f} MiB")
    assert fused_peak <= 0.25 * unfused_peak


def test_dispatch_races_tilelang_and_the_chunked_reference_at_the_llama_output_layer():
    """Both agree (2e-2 of the largest value), both are timed; the faster is the choice (printed with -s)."""
    from loong_kernels.autotune import format_decision

    h, w, t = _data(8192, 2048, 128256)
    chooser = dispatch.Dispatcher()
    args = (h, w, t, -100, None, True, True)
    impl = chooser.choose_op("linear_cross_entropy", *args)
    (decision,) = chooser.autotuner.cache.values()
    print(format_decision(decision))
    assert set(decision.ms) == {"tilelang", "reference"}, decision.skipped
    assert impl == min(decision.ms, key=decision.ms.__getitem__)
    with dispatch.use_dispatcher(chooser):
        hh = h.clone().requires_grad_()
        lk.linear_cross_entropy(hh, w, t).backward()
    assert torch.isfinite(hh.grad).all() and len(chooser.autotuner.cache) == 2  # grads=dh is its own bucket


def test_side_stream_gradient_gemms_give_the_serial_result():
    """The OVERLAP variant (gradient GEMMs of chunk i on a second stream, two logits buffers) must not
    race: same loss and gradients as the serial loop, over several chunks."""
    from loong_kernels.tl import linear_cross_entropy as tl_ce

    h, w, t = _data(4000, 1024, 32000)
    kernel = tl_ce.build_ce(32000, "bfloat16", True)
    serial = tl_ce.chunked_with(kernel, h, w, t, -100, 512, True, True, overlap=False)
    for _ in range(3):
        overlapped = tl_ce.chunked_with(kernel, h, w, t, -100, 512, True, True, overlap=True)
        torch.cuda.synchronize()
        _close(overlapped, serial, loss_tol=1e-6, grad_tol=1e-3)
