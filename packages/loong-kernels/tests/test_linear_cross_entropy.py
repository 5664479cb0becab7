"""Chunked linear + cross-entropy against F.cross_entropy on full logits."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from loong_kernels import linear_cross_entropy
from loong_kernels.reference import linear_cross_entropy_unfused


def _data(n=37, dim=16, vocab=50, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, dim, dtype=dtype, generator=g, requires_grad=True)
    w = torch.randn(vocab, dim, dtype=dtype, generator=g, requires_grad=True)
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::4] = -100
    return h, w, t


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 64])
def test_values_and_grads_match_full_logits(chunk_size):
    h, w, t = _data()
    loss = linear_cross_entropy(h, w, t, chunk_size=chunk_size)
    ref = F.cross_entropy(h @ w.t(), t, ignore_index=-100)
    torch.testing.assert_close(loss.double(), ref)
    got = torch.autograd.grad(loss * 3.0, [h, w])
    want = torch.autograd.grad(ref * 3.0, [h, w])
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e)


def test_custom_ignore_index_and_batch_dims():
    h, w, t = _data(n=24)
    t = torch.where(t == -100, 7, t)
    loss = linear_cross_entropy(h.view(4, 6, -1), w, t.view(4, 6), ignore_index=7, chunk_size=5)
    torch.testing.assert_close(loss.double(), F.cross_entropy(h @ w.t(), t, ignore_index=7))


def test_all_ignored_gives_zero_loss_and_zero_grads():
    h, w, t = _data(n=6)
    loss = linear_cross_entropy(h, w, torch.full_like(t, -100))
    assert loss.item() == 0.0
    gh, gw = torch.autograd.grad(loss, [h, w])
    assert gh.abs().max() == 0 and gw.abs().max() == 0


def test_gradcheck():
    h, w, t = _data(n=7, dim=3, vocab=5)
    assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy(a, b, t, chunk_size=3), (h, w))


def test_only_hidden_requires_grad():
    h, w, t = _data()
    w = w.detach()
    loss = linear_cross_entropy(h, w, t, chunk_size=8)
    (gh,) = torch.autograd.grad(loss, [h])
    h2 = h.detach().requires_grad_()
    (want,) = torch.autograd.grad(F.cross_entropy(h2 @ w.t(), t), [h2])
    torch.testing.assert_close(gh, want)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produced: full logits would be [tokens, vocab]."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, tuple | list) else (out,):
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel() * o.element_size())
        return out


def test_peak_tensor_is_a_chunk_not_the_full_logits():
    n, dim, vocab = 512, 32, 2000
    h, w, t = _data(n=n, dim=dim, vocab=vocab, dtype=torch.float32)
    with _LargestTensor() as fused:
        linear_cross_entropy(h, w, t, chunk_size=64).backward()
    with _LargestTensor() as unfused:
        linear_cross_entropy_unfused(h, w, t).backward()
    full_logits = n * vocab * 4
    assert unfused.largest >= full_logits
    assert fused.largest <= max(64 * vocab * 4, w.numel() * 4)
    assert fused.largest * 4 <= unfused.largest


def _per_token_formula(h, w, t):
    """Each token's loss on full logits; a target outside the vocabulary has none (megatron's rule)."""
    logits = h @ w.t()
    inside = (t >= 0) & (t < w.shape[0])
    picked = logits.gather(1, torch.where(inside, t, 0)[:, None]).squeeze(1)
    return torch.logsumexp(logits, 1) - torch.where(inside, picked, 0.0)


@pytest.mark.parametrize("chunk_size", [1, 8, 64])
def test_per_token_losses_and_their_masked_gradients_match_full_logits(chunk_size):
    from loong_kernels import linear_cross_entropy_per_token

    h, w, t = _data()
    t[5] = w.shape[0] + 3  # outside the vocabulary: counted with weight 1, no target logit
    mask = (torch.arange(t.shape[0]) % 3 != 0).double()
    got = linear_cross_entropy_per_token(h, w, t, mask, chunk_size=chunk_size)
    want = _per_token_formula(h, w, t)
    assert got.dtype == torch.float64 and got.shape == t.shape  # float32 for 16/32-bit inputs
    torch.testing.assert_close(got, want)
    scale = 0.37 / mask.sum()  # any scalar times the masked sum: a token mean, a loss scale
    for g, e in zip(torch.autograd.grad((got * mask).sum() * scale, [h, w]),
                    torch.autograd.grad((want * mask).sum() * scale, [h, w])):  # fmt: skip
        torch.testing.assert_close(g, e)


def test_per_token_losses_refuse_a_gradient_not_proportional_to_the_weights():
    from loong_kernels import linear_cross_entropy_per_token

    h, w, t = _data()
    losses = linear_cross_entropy_per_token(h, w, t, torch.ones(t.shape[0]))
    with pytest.raises(RuntimeError, match="not proportional to token_weight"):
        (losses * torch.arange(t.shape[0])).sum().backward()


def test_per_token_losses_without_grad_mode_compute_no_gradients():
    from loong_kernels import linear_cross_entropy_per_token

    h, w, t = _data()
    with torch.no_grad():
        losses = linear_cross_entropy_per_token(h, w, t, torch.ones(t.shape[0]))
    assert losses.grad_fn is None
    torch.testing.assert_close(losses, _per_token_formula(h, w, t).detach())


def test_the_reference_caps_a_chunk_size_meant_for_the_kernel_at_its_own_default(monkeypatch):
    from loong_kernels.reference import linear_cross_entropy as ref

    n, dim, vocab = 64, 8, 2000
    monkeypatch.setattr(ref, "_CHUNK_LOGIT_BYTES", 16 * vocab * 4)  # a default of 16 tokens
    h, w, t = _data(n=n, dim=dim, vocab=vocab, dtype=torch.float32)
    with torch.no_grad(), _LargestTensor() as capped:
        got = ref.linear_cross_entropy_tokens_chunked(h, w, t, torch.ones(n), 8192, True, True)
    assert capped.largest <= max(16 * vocab * 4, w.numel() * 4) < n * vocab * 4
    want = ref.linear_cross_entropy_tokens_chunked(h.detach(), w.detach(), t, torch.ones(n), 16, True, True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
