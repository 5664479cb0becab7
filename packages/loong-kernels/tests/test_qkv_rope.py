"""qkv_rope: RoPE on megatron's fused QKV rows, against megatron-core's own unfused RoPE."""

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from loong_kernels import qkv_rope, use_implementation
from loong_kernels.reference.qkv_rope import qkv_rope_bwd, qkv_rope_fwd

SEQ, BATCH, GROUPS, R, D = 12, 3, 2, 4, 16


def _angles(seq: int, d: int, base: float = 10000.0, extra: int = 0) -> torch.Tensor:
    """megatron's RotaryEmbedding layout: [seq, 1, 1, d], the two halves equal."""
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.outer(torch.arange(seq + extra, dtype=torch.float32), inv)
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


def _megatron_split_and_rotate(qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor):
    """What megatron's attention does without the fused path: split each group's row, then RoPE."""
    seq, batch, groups, _ = qkv.shape
    q, k, v = torch.split(qkv.view(seq, batch, groups, R + 2, D), [R, 1, 1], dim=3)
    q = q.reshape(seq, batch, groups * R, D)
    k, v = k.reshape(seq, batch, groups, D), v.reshape(seq, batch, groups, D)
    return _apply_rotary_pos_emb_bshd(q, q_freqs[:seq]), _apply_rotary_pos_emb_bshd(k, k_freqs[:seq]), v


def test_it_splits_and_rotates_as_megatrons_own_rope_does():
    qkv = torch.randn(SEQ, BATCH, GROUPS, (R + 2) * D)
    freqs = _angles(SEQ, D, extra=5)  # (more positions than the sequence: the first ones apply)
    got = qkv_rope(qkv, freqs, freqs, R)
    want = _megatron_split_and_rotate(qkv, freqs, freqs)
    for g, w, name in zip(got, want, "qkv", strict=True):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6, msg=name)


def test_q_and_k_take_their_own_angles_and_the_gradients_are_megatrons():
    qkv = torch.randn(SEQ, BATCH, GROUPS, (R + 2) * D)
    q_freqs, k_freqs = _angles(SEQ, D), _angles(SEQ, D, base=500.0)
    mine, theirs = qkv.clone().requires_grad_(), qkv.clone().requires_grad_()
    weights = [torch.randn(SEQ, BATCH, GROUPS * R, D), torch.randn(SEQ, BATCH, GROUPS, D), torch.randn(SEQ, BATCH, GROUPS, D)]
    for x, fn in ((mine, lambda t: qkv_rope(t, q_freqs, k_freqs, R)), (theirs, lambda t: _megatron_split_and_rotate(t, q_freqs, k_freqs))):
        sum((o * w).sum() for o, w in zip(fn(x), weights)).backward()
    torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-5, rtol=1e-5)


def test_the_reference_backward_is_the_transpose_of_its_forward():
    x = torch.randn(SEQ * BATCH * GROUPS, (R + 2) * D, dtype=torch.float64, requires_grad=True)
    angles = _angles(SEQ, D).reshape(SEQ, D)
    tables = (torch.cos(angles), torch.sin(angles), torch.cos(2 * angles), torch.sin(2 * angles))
    outs = qkv_rope_fwd(x, *tables, R, BATCH * GROUPS)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.testing.assert_close(qkv_rope_bwd(*grads, *tables, R, BATCH * GROUPS), x.grad)


def test_a_gradient_that_reaches_only_some_outputs_still_flows():
    qkv = torch.randn(SEQ, BATCH, GROUPS, (R + 2) * D, requires_grad=True)
    freqs = _angles(SEQ, D)
    q, k, v = qkv_rope(qkv, freqs, freqs, R)
    v.sum().backward()  # q and k unused: their gradients are zero
    want = torch.zeros_like(qkv).view(SEQ, BATCH, GROUPS, R + 2, D)
    want[:, :, :, R + 1] = 1.0
    assert torch.equal(qkv.grad, want.view_as(qkv))


@pytest.mark.parametrize(("shape", "freqs", "match"), [
    ((SEQ, BATCH, GROUPS, (R + 2) * D + 1), _angles(SEQ, D), r"qkv must be \[seq, batch, groups, \(4 \+ 2\) \* head_dim\]"),
    ((SEQ, BATCH, GROUPS, (R + 2) * D), _angles(SEQ - 1, D), r"q_freqs must hold at least 12 positions of 16 angles"),
    ((SEQ, BATCH, GROUPS, (R + 2) * 15), _angles(SEQ, 15), r"head_dim must be even"),
])  # fmt: skip
def test_inputs_of_the_wrong_shape_are_refused_naming_the_argument(shape, freqs, match):
    with pytest.raises(ValueError, match=match), use_implementation("reference"):
        qkv_rope(torch.randn(*shape), freqs, freqs, R)
