"""The SigLIP vision tower as PaliGemma uses it: patch embedding, learned positions, pre-norm
encoder layers (GELU-tanh MLP), a final LayerNorm; no pooling head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loong_models.embodied.pi05.config import SiglipConfig


class SiglipLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.layer_norm1 = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.layer_norm2 = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))
        self.fc1 = nn.Linear(h, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.layer_norm1(x)
        q, k, v = (
            p(y).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h)
        x = x + self.out_proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class SiglipTower(nn.Module):
    def __init__(self, cfg: SiglipConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.num_patches, cfg.hidden_size)
        self.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(cfg.num_layers))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, H, W] in [-1, 1] -> patch features [B, patches, hidden]."""
        x = self.patch_embedding(images).flatten(2).transpose(1, 2) + self.position_embedding.weight
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)
