"""Flow matching as Wan trains it (DiffSynth-Studio's ``FlowMatchScheduler`` / ``FlowMatchSFTLoss``,
re-derived from its formulas), and the Euler sampler that inverts it.

Training: 1000 noise levels ``sigma_k = shift * s_k / (1 + (shift - 1) * s_k)`` with ``s_k``
evenly spaced from 1 down to 1/1000 (descending, so index 0 is pure noise); a sample draws an index
uniformly in ``[min_boundary, max_boundary) * 1000`` (Wan2.2's experts train on sub-ranges), then
``x_t = (1 - sigma) x0 + sigma * eps``, target ``eps - x0`` (the velocity), timestep ``1000 sigma``.
The loss is the per-sample MSE times a bell-shaped weight of the timestep,
``exp(-2 ((t - 500) / 1000)^2)``, shifted to 0 at its minimum and normalised to mean 1 over the
1000 levels. Noise and index come from a generator seeded by (seed, sample id), so a resumed run
draws exactly what the uninterrupted one did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch


class Weighting(StrEnum):
    """How the loss of a sample is weighted by its timestep."""

    bell = "bell"  # Wan / DiffSynth
    uniform = "uniform"


@dataclass
class FlowMatchingConfig:
    shift: float = 5.0
    num_train_timesteps: int = 1000
    min_boundary: float = 0.0  # fraction of the (descending) noise levels a sample may draw from
    max_boundary: float = 1.0
    weighting: Weighting = Weighting.bell

    def validate(self, prefix: str = "objective") -> None:
        if not 0.0 <= self.min_boundary < self.max_boundary <= 1.0:
            raise ValueError(f"{prefix}: need 0 <= min_boundary < max_boundary <= 1, got "
                             f"{self.min_boundary}, {self.max_boundary}")  # fmt: skip
        if self.shift <= 0 or self.num_train_timesteps < 1:
            raise ValueError(f"{prefix}: shift={self.shift} must be > 0, num_train_timesteps >= 1")


def shifted_sigmas(steps: int, shift: float) -> torch.Tensor:
    """``steps`` descending noise levels from 1 (pure noise), shifted toward noise (fp64)."""
    s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)[:-1]
    return shift * s / (1 + (shift - 1) * s)


def training_weights(timesteps: torch.Tensor, n: int) -> torch.Tensor:
    """Wan's bell weighting of each training timestep (mean 1 over the ``n`` levels)."""
    y = torch.exp(-2 * ((timesteps - n / 2) / n) ** 2)
    y = y - y.min()
    return y * (n / y.sum())


@dataclass(frozen=True)
class FlowMatchBatch:
    noisy: torch.Tensor  # x_t, the model's input
    timestep: torch.Tensor  # [b] (1000 sigma)
    target: torch.Tensor  # eps - x0
    weight: torch.Tensor  # [b] loss weight per sample


class FlowMatching:
    """The training objective: ``prepare`` noises a batch, ``loss`` weighs the model's error."""

    def __init__(self, cfg: FlowMatchingConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        n = cfg.num_train_timesteps
        self.sigmas = shifted_sigmas(n, cfg.shift)
        self.timesteps = self.sigmas * n
        self.weights = training_weights(self.timesteps, n) if cfg.weighting == "bell" else torch.ones(n, dtype=torch.float64)

    def draw(self, sample_id: int, seed: int, shape: Sequence[int]) -> tuple[int, torch.Tensor]:
        """(noise-level index, noise) of one sample: a function of (seed, sample_id) only."""
        g = torch.Generator().manual_seed((seed * 1_000_003 + sample_id) % 2**63)
        n = self.cfg.num_train_timesteps
        lo, hi = int(self.cfg.min_boundary * n), int(self.cfg.max_boundary * n)
        index = int(torch.randint(lo, hi, (1,), generator=g))
        return index, torch.randn(tuple(shape), generator=g)

    def prepare(self, x0: torch.Tensor, sample_ids: Sequence[int], seed: int) -> FlowMatchBatch:
        drawn = [self.draw(i, seed, x0.shape[1:]) for i in sample_ids]
        idx = torch.tensor([k for k, _ in drawn])
        eps = torch.stack([e for _, e in drawn]).to(x0.device, torch.float32)
        sigma = self.sigmas[idx].float().to(x0.device).view(-1, *([1] * (x0.dim() - 1)))
        x0f = x0.float()
        return FlowMatchBatch(
            noisy=((1 - sigma) * x0f + sigma * eps).to(x0.dtype),
            timestep=self.timesteps[idx].float().to(x0.device),
            target=eps - x0f,
            weight=self.weights[idx].float().to(x0.device),
        )

    @staticmethod
    def per_sample_loss(pred: torch.Tensor, batch: FlowMatchBatch, target: torch.Tensor | None = None) -> torch.Tensor:
        """[b]: each sample's weighted MSE (average them for the batch loss). With ``target`` (a
        part of ``batch.target`` in any layout, e.g. a context-parallel rank's patch tokens) and
        ``pred`` its prediction: that part's share, squared errors summed over the part and
        divided by the whole sample's size (the parts' shares add up to the MSE)."""
        if target is None:
            return (pred.float() - batch.target).pow(2).flatten(1).mean(1) * batch.weight
        sq = (pred.float() - target.float()).pow(2).flatten(1).sum(1)
        return sq / batch.target[0].numel() * batch.weight


@torch.no_grad()
def euler_sample(
    velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    noise: torch.Tensor,
    *,
    steps: int = 20,
    shift: float = 5.0,
    num_train_timesteps: int = 1000,
) -> torch.Tensor:
    """Integrate the flow from ``noise`` (sigma 1) to data (sigma 0) in ``steps`` Euler steps on
    the shifted schedule; ``velocity(x, timestep [b])`` is the model (eps - x0 prediction)."""
    sigmas = shifted_sigmas(steps, shift).tolist() + [0.0]
    x = noise.float()
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        t = torch.full((x.shape[0],), s * num_train_timesteps, device=x.device)
        x = x + velocity(x.to(noise.dtype), t).float() * (s_next - s)
    return x
