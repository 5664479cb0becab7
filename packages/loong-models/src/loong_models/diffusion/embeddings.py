"""Wan's position and timestep encodings: 3-D RoPE over (frame, row, column) of each latent
patch, and the sinusoidal timestep features."""

from __future__ import annotations

import math

import torch


def rope_3d(
    grid: tuple[int, int, int], split: tuple[int, int, int], theta: float, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[f*h*w, 1, 1, head_dim/2]`` (fp32) for a ``grid`` of (frames, rows, columns)
    patches in raster order: each of the three head-dim parts rotates with one coordinate."""
    parts = []
    for n, d, axis in zip(grid, split, range(3)):
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
        ang = torch.arange(n, dtype=torch.float64, device=device)[:, None] * inv  # [n, d/2]
        shape = [1, 1, 1, d // 2]
        shape[axis] = n
        parts.append(ang.view(shape).expand(*grid, d // 2))
    ang = torch.cat(parts, dim=-1).reshape(-1, 1, 1, sum(split) // 2)
    return ang.cos().float(), ang.sin().float()


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``[..., dim]`` sinusoidal features of timesteps ``t`` (cos first, then sin; diffusers'
    ``Timesteps(flip_sin_to_cos=True, downscale_freq_shift=0)``)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    ang = t.float()[..., None] * freqs
    return torch.cat([ang.cos(), ang.sin()], dim=-1)
