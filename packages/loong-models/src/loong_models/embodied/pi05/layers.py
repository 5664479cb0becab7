"""Gemma's pieces for Pi0.5: (1 + w) RMSNorm, adaRMS, the GeGLU MLP, RoPE, and the joint layer
in which the VLM and the action expert share one attention over their concatenated tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loong_models.embodied.pi05.config import GemmaConfig


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    # the variance in fp32 whatever the activations' dtype, as Gemma does
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from one, ``x * (1 + w)``."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        return (rms(x, self.eps) * (1.0 + self.weight.float())).type_as(x), None


class AdaRMSNorm(nn.Module):
    """adaRMS: the condition (the flow time's embedding) gives a scale, a shift and a gate for the
    residual branch that follows; the linear starts at zero, i.e. as a plain RMSNorm, ungated."""

    def __init__(self, width: int, cond_width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_width, 3 * width)
        nn.init.zeros_(self.dense.weight)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale, shift, gate = self.dense(cond).unsqueeze(1).chunk(3, dim=-1)
        normed = rms(x, self.eps) * (1 + scale.float()) + shift.float()
        return normed.to(x.dtype), gate.to(x.dtype)


class GemmaMLP(nn.Module):
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, width: int, mlp_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, mlp_dim, bias=False)
        self.up_proj = nn.Linear(width, mlp_dim, bias=False)
        self.down_proj = nn.Linear(mlp_dim, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaBlock(nn.Module):
    """One expert's share of a joint layer: its norms, QKV / output projections and MLP."""

    def __init__(self, cfg: GemmaConfig, cond_width: int | None) -> None:
        super().__init__()
        self.cfg = cfg

        def norm() -> nn.Module:
            if cond_width is None:
                return GemmaRMSNorm(cfg.width, cfg.norm_eps)
            return AdaRMSNorm(cfg.width, cond_width, cfg.norm_eps)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.q_proj = nn.Linear(cfg.width, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.width, bias=False)
        self.mlp = GemmaMLP(cfg.width, cfg.mlp_dim)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, s, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x).view(b, s, -1, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, hd).transpose(1, 2)
        return q, k, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor, gate: torch.Tensor | None, cond) -> torch.Tensor:
        """Output projection, gated residual, post-attention norm, MLP, gated residual."""
        x = gated_residual(x, self.o_proj(attn), gate)
        h, gate = self.post_attention_layernorm(x, cond)
        return gated_residual(x, self.mlp(h), gate)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + y if gate is None else x + y * gate


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, halves layout (HF Gemma's ``rotate_half``); positions [B, S]."""
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (torch.arange(0, half, device=x.device, dtype=torch.float32) / half)
    angles = positions[:, None, :, None].float() * inv  # [B, 1, S, half]
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(x.dtype), torch.cat([angles.sin()] * 2, -1).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean [B, Sq, Sk] mask as an additive [B, 1, Sq, Sk] bias with a finite minimum, so that
    a padded query row (one that may see nothing) averages instead of producing NaN, which would
    leak through the zero weights."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, torch.finfo(dtype).min
    )[:, None]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """torch's SDPA (with a mask: its memory-efficient kernel on CUDA), KV heads repeated per group."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Two matmuls around an fp32 softmax. The query heads of a group are stacked along the
    sequence, so the shared KV head is used as it is (no repeated K/V). At Pi0.5's short
    sequences (~500 tokens) and head_dim 256 this beats the memory-efficient kernel's backward,
    and torch.compile fuses the softmax."""
    b, h, s, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, kv, (h // kv) * s, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().view(b, kv, h // kv, s, -1) * d**-0.5
    probs = (scores + bias[:, :, None]).softmax(dim=-1).to(v.dtype).view(b, kv, (h // kv) * s, -1)
    return torch.matmul(probs, v).view(b, h, s, d)


ATTENTION = {"sdpa": sdpa_attention, "eager": eager_attention}


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, impl: str = "sdpa"
) -> torch.Tensor:
    """Attention over [B, H, S, D] with KV heads shared by query groups and a boolean [B, Sq, Sk]
    mask; returns [B, Sq, H * D]."""
    out = ATTENTION[impl](q, k, v, attention_bias(mask, q.dtype))
    b, h, s, d = out.shape
    return out.transpose(1, 2).reshape(b, s, h * d)


class JointLayer(nn.Module):
    """A mixture-of-transformers layer: the VLM block (prefix tokens) and the expert block (action
    tokens) keep their own weights but attend in one softmax over both token sets."""

    def __init__(self, vlm: GemmaConfig, expert: GemmaConfig, attention_impl: str = "sdpa") -> None:
        super().__init__()
        self.attention_impl = attention_impl
        self.vlm = GemmaBlock(vlm, cond_width=None)
        self.expert = GemmaBlock(expert, cond_width=expert.width)

    def forward(self, xs: list[torch.Tensor], cond: torch.Tensor, mask, positions, theta: float,
                prefix_out: bool = True) -> list:  # fmt: skip
        """Both token sets through the layer; with ``prefix_out=False`` (the last layer in training:
        nothing reads the prefix after it) the VLM block stops after its keys and values and the
        prefix comes back unchanged."""
        blocks = (self.vlm, self.expert)
        normed = [blk.input_layernorm(x, c) for blk, x, c in zip(blocks, xs, (None, cond))]
        qkvs = [blk.qkv(h) for blk, (h, _) in zip(blocks, normed)]
        q, k, v = (torch.cat(t, dim=2) for t in zip(*qkvs))
        q, k = rope(q, positions, theta), rope(k, positions, theta)
        p = xs[0].shape[1]
        if not prefix_out:  # the expert's queries only: the prefix's rows of the attention are unused
            out = attention(q[:, :, p:], k, v, mask[:, p:], self.attention_impl)
            return [xs[0], self.expert.finish(xs[1], out, normed[1][1], cond)]
        out = attention(q, k, v, mask, self.attention_impl).split([p, xs[1].shape[1]], dim=1)
        return [blk.finish(x, o, g, c) for blk, x, o, (_, g), c in zip(blocks, xs, out, normed, (None, cond))]

    def prefix_kv(self, x: torch.Tensor, mask, positions, theta: float) -> tuple[torch.Tensor, tuple]:
        """The VLM alone over the prefix (inference): its output and its (post-RoPE) keys/values."""
        h, _ = self.vlm.input_layernorm(x)
        q, k, v = self.vlm.qkv(h)
        q, k = rope(q, positions, theta), rope(k, positions, theta)
        return self.vlm.finish(x, attention(q, k, v, mask, self.attention_impl), None, None), (k, v)

    def suffix_with_cache(self, x, cache: tuple, cond, mask, positions, theta: float) -> torch.Tensor:
        """The expert alone over the action tokens, attending to the cached prefix keys/values."""
        h, gate = self.expert.input_layernorm(x, cond)
        q, k, v = self.expert.qkv(h)
        q, k = rope(q, positions, theta), rope(k, positions, theta)
        k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        return self.expert.finish(x, attention(q, k, v, mask, self.attention_impl), gate, cond)
