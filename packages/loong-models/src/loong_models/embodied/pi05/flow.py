"""Flow matching over action chunks, as Pi0 / Pi0.5 train it.

``x_t = t * noise + (1 - t) * actions`` moves from the data (t = 0) to noise (t = 1); the model
predicts the velocity ``u = noise - actions``; sampling integrates it with Euler steps from
t = 1 down to t = 0. Training times follow Beta(1.5, 1) (more weight near the noisy end),
squeezed into [0.001, 1)."""

from __future__ import annotations

import math

import torch

from loong_models.embodied.pi05.config import Pi05Config


def sample_time(cfg: Pi05Config, batch: int, generator: torch.Generator | None = None) -> torch.Tensor:
    a, b = cfg.time_sampling_beta_alpha, cfg.time_sampling_beta_beta
    # Beta from two Gammas drawn with an explicit generator: reproducible per rank and step
    # (torch.distributions draws from the global RNG only)
    x = torch._standard_gamma(torch.full((batch,), a), generator=generator)
    y = torch._standard_gamma(torch.full((batch,), b), generator=generator)
    return (x / (x + y)) * cfg.time_sampling_scale + cfg.time_sampling_offset


def noisy_actions(actions: torch.Tensor, noise: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
    t = time[:, None, None]
    return t * noise + (1 - t) * actions


def velocity_target(actions: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - actions


def time_embedding(time: torch.Tensor, width: int, min_period: float, max_period: float) -> torch.Tensor:
    """Sine-cosine embedding of the flow time (periods geometric in [min_period, max_period]),
    computed in float64 as OpenPI does, returned in the time's dtype."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=time.device)
    period = min_period * (max_period / min_period) ** fraction
    angles = time[:, None] * (2 * math.pi / period)
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(time.dtype)


def euler_sample(velocity, noise: torch.Tensor, steps: int) -> torch.Tensor:
    """Integrate ``velocity(x_t, t)`` from t = 1 (noise) to t = 0 in ``steps`` equal steps."""
    dt = -1.0 / steps
    x = noise
    for i in range(steps):
        t = torch.full((noise.shape[0],), 1.0 + i * dt, dtype=torch.float32, device=noise.device)
        x = x + dt * velocity(x, t)
    return x
