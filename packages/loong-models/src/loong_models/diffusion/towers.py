"""Configs of the frozen towers a diffusion model trains against: the video VAE that makes the
latents (diffusers ``AutoencoderKLWan``) and the text encoder (transformers ``UMT5EncoderModel``).
Fields carry the reference classes' names, so a config builds the reference module directly."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class VaeConfig:
    """``diffusers.AutoencoderKLWan`` keyword arguments (Wan2.1: base_dim 96, z_dim 16)."""

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: list[int] = field(default_factory=lambda: [1, 2, 4, 4])
    num_res_blocks: int = 2
    temperal_downsample: list[bool] = field(default_factory=lambda: [False, True, True])

    @property
    def spatial_compression(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def temporal_compression(self) -> int:
        return 2 ** sum(self.temperal_downsample)

    def validate(self, prefix: str = "model.vae") -> None:
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(f"{prefix}.temperal_downsample needs len(dim_mult) - 1 = {len(self.dim_mult) - 1} "
                             f"entries, got {len(self.temperal_downsample)}")  # fmt: skip
        for key in ("base_dim", "z_dim", "num_res_blocks"):
            if getattr(self, key) < 1:
                raise ValueError(f"{prefix}.{key}={getattr(self, key)} must be >= 1")

    def kwargs(self) -> dict:
        return dict(base_dim=self.base_dim, z_dim=self.z_dim, dim_mult=list(self.dim_mult),
                    num_res_blocks=self.num_res_blocks, temperal_downsample=list(self.temperal_downsample))  # fmt: skip


@dataclass
class TextEncoderConfig:
    """``transformers.UMT5Config`` fields of the encoder (umT5-XXL: d_model 4096, 24 layers)."""

    vocab_size: int = 256384
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    # a tokenizer directory (tokenizer.json); null = loong-data's bundled SentencePiece tokenizer
    tokenizer: str | None = None

    def validate(self, prefix: str = "model.text_encoder") -> None:
        for key in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads"):
            if getattr(self, key) < 1:
                raise ValueError(f"{prefix}.{key}={getattr(self, key)} must be >= 1")
