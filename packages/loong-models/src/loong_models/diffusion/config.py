"""The Wan 2.x diffusion transformer's config: the schema its YAML files fill and its exact
parameter count, computed without building anything. Field names follow diffusers'
``WanTransformer3DModel`` config (``dim`` = heads x head_dim)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum


class DiTRecompute(StrEnum):
    """What the backward recomputes of a layer (null: nothing, every activation is kept)."""

    full = "full"  # whole layers: only each layer's input is kept
    # everything but the self-attention kernel: its q, k, v and output are kept (its backward needs
    # them anyway), so the costliest forward (O(tokens^2)) runs once; ~4 x dim x tokens more memory
    keep_attention = "keep_attention"


@dataclass
class WanConfig:
    """A Wan DiT: 3-D patch embedding of VAE latents, timestep adaLN modulation, self-attention
    with 3-D RoPE and q/k RMSNorm across heads, cross-attention to text (and CLIP image tokens
    for Wan2.1 I2V), a GELU-tanh FFN, and an adaLN-modulated linear head."""

    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 24  # must split into frame / height / width RoPE parts (see rope_split)
    ffn_dim: int = 96
    in_channels: int = 16  # latent channels (+ mask and first-frame latents for I2V: 36)
    out_channels: int = 16
    patch_size: list[int] = field(default_factory=lambda: [1, 2, 2])  # (frames, height, width)
    text_dim: int = 4096  # the text encoder's width (umT5-XXL: 4096)
    text_len: int = 512  # text tokens per sample (padded with zeros, attended like Wan)
    freq_dim: int = 256  # sinusoidal timestep features
    eps: float = 1e-6
    cross_attn_norm: bool = True
    # Wan2.1 I2V: CLIP image features (width image_dim, image_len tokens) as extra cross-attention keys
    image_dim: int | None = None
    image_len: int = 257
    rope_max_seq_len: int = 1024
    rope_theta: float = 10000.0
    init_method_std: float = 0.02
    # Component-level settings (as for the other components)
    tensor_model_parallel_size: int | None = None
    freeze: bool = False
    recompute: DiTRecompute | None = None
    # how many layers (the first ones) recompute; the others keep every activation (null: all)
    recompute_num_layers: int | None = None
    # torch.compile the layers' pointwise chains (norms, modulation, RoPE, gated residuals: one
    # kernel each; loong_models.diffusion.pointwise); null: on with the TE backend (CUDA)
    fuse_pointwise: bool | None = None
    extra: dict = field(default_factory=dict)  # passed to the component's TransformerConfig

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Head-dim channels rotated by frame, row and column position (Wan: d - 4(d//6), 2(d//6), 2(d//6))."""
        hw = 2 * (self.attention_head_dim // 6)
        return self.attention_head_dim - 2 * hw, hw, hw

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)

    def validate(self, prefix: str = "model.diffusion") -> None:
        for key in ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim", "in_channels",
                    "out_channels", "text_dim", "text_len", "freq_dim"):  # fmt: skip
            if getattr(self, key) < 1:
                raise ValueError(f"{prefix}.{key}={getattr(self, key)} must be >= 1")
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(f"{prefix}.patch_size={list(self.patch_size)} must be 3 sizes >= 1 (frames, height, width)")
        if self.freq_dim % 2:
            raise ValueError(f"{prefix}.freq_dim={self.freq_dim} must be even")
        if any(p % 2 for p in self.rope_split) or min(self.rope_split) < 2:
            raise ValueError(f"{prefix}.attention_head_dim={self.attention_head_dim} does not split into even "
                             f"frame/height/width RoPE parts {self.rope_split} (e.g. 24 or 128)")  # fmt: skip
        if self.tensor_model_parallel_size is not None and self.tensor_model_parallel_size < 1:
            raise ValueError(f"{prefix}.tensor_model_parallel_size={self.tensor_model_parallel_size} must be >= 1")
        n = self.recompute_num_layers
        if n is not None and (self.recompute is None or not 0 <= n <= self.num_layers):
            raise ValueError(f"{prefix}.recompute_num_layers={n} must be null or in [0, num_layers="
                             f"{self.num_layers}], with {prefix}.recompute set (it is {self.recompute})")  # fmt: skip
        if self.image_dim is not None and self.image_len < 1:
            raise ValueError(f"{prefix}.image_len={self.image_len} must be >= 1 with image_dim set")

    def num_parameters(self) -> int:
        """Exact parameter count of the transformer (the released checkpoints' count)."""
        d, f = self.dim, self.ffn_dim
        lin = lambda i, o: i * o + o  # noqa: E731
        attn = 4 * lin(d, d) + 2 * d  # q, k, v, out + q/k RMSNorm across heads
        cross = attn + (2 * lin(d, d) + d if self.image_dim is not None else 0)
        layer = attn + cross + lin(d, f) + lin(f, d) + 6 * d + (2 * d if self.cross_attn_norm else 0)
        n = self.num_layers * layer
        n += self.in_channels * self.patch_volume * d + d  # patch embedding (Conv3d)
        n += lin(self.freq_dim, d) + lin(d, d) + lin(d, 6 * d)  # timestep MLP + modulation projection
        n += lin(self.text_dim, d) + lin(d, d)  # text projection
        if self.image_dim is not None:  # CLIP image projection: LayerNorm, MLP, LayerNorm
            i = self.image_dim
            n += 2 * i + lin(i, i) + lin(i, d) + 2 * d
        n += lin(d, self.out_channels * self.patch_volume) + 2 * d  # head + its modulation
        return n

    def flops_per_token(self, tokens: int) -> float:
        """Training FLOPs per latent token of a ``tokens``-long sample (forward + backward):
        6 x the per-token matmul parameters + self-attention (12 L d s) + cross-attention to the
        text (12 L d text_len)."""
        d, L = self.dim, self.num_layers
        # per latent token: self-attention q, k, v, out; cross-attention q, out (its k, v run on the text)
        dense = L * (6 * d * d + 2 * d * self.ffn_dim)
        return 6 * dense + 12 * L * d * tokens + 12 * L * d * self.text_len
