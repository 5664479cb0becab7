"""The TileLang linear + cross-entropy without a GPU: its algorithm (a torch emulation of the kernel,
lane for lane, run through the real chunk loop) against the references, and its place in the dispatcher."""

import pytest
import torch
import torch.nn.functional as F

from loong_kernels import dispatch, linear_cross_entropy, use_implementation
from loong_kernels.reference import linear_cross_entropy_chunked
from loong_kernels.testing import emulated_ce_kernel as emulated_kernel
from loong_kernels.tilelang_support import tilelang_importable

pytestmark = pytest.mark.skipif(not tilelang_importable(), reason="the kernel module imports tilelang")


@pytest.mark.parametrize("vocab", [1000, 2048, 5000, 128256])
def test_the_kernels_lane_wise_online_softmax_gives_the_logsumexp(vocab):
    g = torch.Generator().manual_seed(vocab)
    # a wide spread and a large offset: the running max must keep exp2 from overflowing
    logits = (torch.randn(6, vocab, generator=g) * 30 + 50).to(torch.bfloat16)
    scale = torch.tensor([0.25, 0.0, 1.0, 0.5, 0.125, 1.0])
    lse = torch.empty(6)
    want = torch.logsumexp(logits.double(), 1)
    probs = torch.softmax(logits.double(), 1) * scale[:, None].double()
    emulated_kernel(True)(logits, scale, lse)
    torch.testing.assert_close(lse.double(), want, atol=1e-4, rtol=1e-6)
    # in place: softmax * scale, rounded to bf16
    torch.testing.assert_close(logits.double(), probs, atol=1e-6, rtol=1e-2)


def _data(n=300, dim=64, vocab=5000, seed=0, ignore=-100):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, dim, generator=g) * 0.5).to(torch.bfloat16)
    w = (torch.randn(vocab, dim, generator=g) * 0.3).to(torch.bfloat16)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::7] = ignore
    return h, w, t


def _tilelang_emulated(h, w, t, ignore_index=-100, chunk_size=128, dh=True, dw=True):
    from loong_kernels.tl.linear_cross_entropy import chunked_with

    return chunked_with(emulated_kernel(dh or dw), h, w, t, ignore_index, chunk_size, dh, dw)


def test_chunk_loop_with_the_emulated_kernel_matches_the_float32_formula():
    h, w, t = _data()
    loss, dh, dw = _tilelang_emulated(h, w, t)  # 128-token chunks: 3, the last one partial
    hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
    ref = F.cross_entropy(hh @ ww.t(), t, ignore_index=-100)
    ref.backward()
    # logits and dlogits are bf16 (as in the unfused bf16 formula): bf16 tolerances
    torch.testing.assert_close(loss, ref.detach(), atol=2e-2, rtol=1e-2)
    for got, want in ((dh, hh.grad), (dw, ww.grad)):
        torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=0)


def test_chunk_loop_with_the_emulated_kernel_matches_the_chunked_reference_closely():
    h, w, t = _data(seed=1)
    got = _tilelang_emulated(h, w, t, chunk_size=100)
    want = linear_cross_entropy_chunked(h, w, t, -100, 100, True, True)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-5)
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2 * b.abs().max().item(), rtol=0)


def test_custom_ignore_index_and_only_the_asked_gradients():
    h, w, t = _data(ignore=7)
    t[t == -100] = 3
    loss, dh, dw = _tilelang_emulated(h, w, t, ignore_index=7, dw=False)
    assert dw is None
    hh = h.float().requires_grad_()
    ref = F.cross_entropy(hh @ w.float().t(), t, ignore_index=7)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(dh.float(), hh.grad, atol=2e-2 * hh.grad.abs().max().item(), rtol=0)
    loss_only = _tilelang_emulated(h, w, t, ignore_index=7, dh=False, dw=False)
    assert loss_only[1] is None and loss_only[2] is None
    torch.testing.assert_close(loss_only[0], loss)


def test_all_ignored_gives_zero_loss_and_zero_gradients():
    h, w, t = _data(n=40)
    loss, dh, dw = _tilelang_emulated(h, w, torch.full_like(t, -100))
    assert loss.item() == 0.0 and dh.abs().max() == 0 and dw.abs().max() == 0


def test_linear_cross_entropy_is_measured_between_tilelang_and_the_chunked_reference():
    from loong_kernels.tl import linear_cross_entropy as tl_ce

    entry = dispatch.KERNELS["linear_cross_entropy"]
    assert dispatch._load(entry.tilelang) is tl_ce.linear_cross_entropy
    assert dispatch._load(entry.reference) is linear_cross_entropy_chunked
    fns = dispatch.op_kernels("linear_cross_entropy", "tilelang")
    assert fns == {"linear_cross_entropy": tl_ce.linear_cross_entropy}
    h, w, t = _data(n=10, vocab=128256, dim=8)
    args = (h, w, t, -100, None, True, False)
    assert dispatch._load(dispatch.TUNED["linear_cross_entropy"].key)(*args) == ("T<=16", "D=8", "V=128256", "grads=dh")
    assert tl_ce.supports(*args) and tl_ce.default_chunk_size(128256) == 2048
    assert not tl_ce.supports(h, w[:-1], *args[2:])  # rows of 128255 bf16 are not 16-byte aligned


def test_on_cpu_the_reference_runs_untimed_and_tilelang_cannot_be_forced(monkeypatch):
    h, w, t = _data(n=12, vocab=64, dim=8)
    chooser = dispatch.Dispatcher()
    args = (h, w, t, -100, None, True, True)
    with dispatch.use_dispatcher(chooser):
        assert chooser.choose_op("linear_cross_entropy", *args) == "reference"
        monkeypatch.setenv(dispatch.ENV_VAR, "megatron")  # no megatron-core version: the automatic choice
        assert chooser.choose_op("linear_cross_entropy", *args) == "reference"
        with use_implementation("tilelang"), pytest.raises(RuntimeError, match="linear_cross_entropy: TileLang was requested"):
            linear_cross_entropy(h.requires_grad_(), w, t)
    assert not chooser.autotuner.cache


def test_the_side_stream_variant_runs_serially_off_cuda():
    from loong_kernels.tl.linear_cross_entropy import chunked_with

    h, w, t = _data(n=200)
    serial = chunked_with(emulated_kernel(True), h, w, t, -100, 64, True, True)
    overlapped = chunked_with(emulated_kernel(True), h, w, t, -100, 64, True, True, overlap=True)
    for a, b in zip(serial, overlapped, strict=True):
        assert torch.equal(a, b)


def test_the_per_token_chunk_loop_with_the_emulated_kernel_matches_the_reference():
    """loong_kernels.tl's per-token form (the output layer's loss in training) against the chunked
    reference's: losses, and the gradients of the mask-weighted sum, with a partial last chunk."""
    from loong_kernels.reference import linear_cross_entropy_tokens_chunked
    from loong_kernels.tl.linear_cross_entropy import chunked_tokens_with

    h, w, t = _data()
    t[3] = w.shape[0] + 1  # outside the vocabulary: the logsumexp alone
    scale = (torch.arange(t.shape[0]) % 5 != 0).float() * 0.01
    got = chunked_tokens_with(emulated_kernel(True), h, w, t, scale, 128, True, True)
    want = linear_cross_entropy_tokens_chunked(h, w, t, scale, 128, True, True)
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=1e-2)  # bf16 logits either way
    for g, e in zip(got[1:], want[1:]):
        assert ((g.float() - e.float()).norm() / e.float().norm()).item() < 1e-2
