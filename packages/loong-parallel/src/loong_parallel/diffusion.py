"""The diffusion-transformer model kind (Wan): what the trainer needs to build, step and measure
it, beside :class:`loong_parallel.kinds.LanguageModel`.

The forward step draws each sample's noise level and noise from ``(seed, sample id)``
(:class:`loong_models.diffusion.FlowMatching`), so a resumed run reproduces the same losses, and
every tensor-parallel rank of a sample noises it identically. The loss of a micro-batch is the sum
of its samples' weighted MSE with the sample count, so megatron's per-token loss normalisation
makes the step loss the mean over the global batch's samples.

Context parallelism (``parallel.cp``): every CP rank of a sample noises it identically, the model
predicts this rank's part of its patch tokens, and the loss is that part's share of each sample's
MSE (squared errors summed over the part, divided by the whole sample's size); one rank of the CP
group counts the samples. megatron sums losses, gradients and counts over DP x CP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core import parallel_state as mpu
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_models import ModelConfig, build_model, build_transformer_config, fusion_fields, resolve_backend
from loong_models.diffusion import FlowMatchBatch, FlowMatching, FlowMatchingConfig
from loong_models.diffusion.tokens import context_parallel_part, patch_tokens
from loong_parallel.config import ParallelConfig
from loong_parallel.model import ModelProvider
from loong_parallel.runtime import runtime_transformer_fields
from loong_parallel.step import LOSS_KEY


def diffusion_forward_step(device: torch.device, objective: FlowMatching, seed: int, patch_size: list[int],
                           data_iterator, model, return_schedule_plan: bool = False):  # fmt: skip
    """megatron's ``forward_step_func`` for a micro-batch ``{latents, context, sample_ids}``."""
    if return_schedule_plan:
        raise ValueError("a diffusion model has no combined 1F1B schedule plan (parallel.moe_a2a_overlap)")
    batch = next(data_iterator)
    x0 = batch["latents"].to(device, non_blocking=True)
    fm = objective.prepare(x0, batch["sample_ids"].tolist(), seed)
    pred = model(fm.noisy, fm.timestep, batch["context"].to(device, non_blocking=True))
    cp = mpu.get_context_parallel_world_size()
    if cp == 1:
        return pred, partial(flow_matching_loss, fm, None, True)
    rank = mpu.get_context_parallel_rank()
    target = patch_tokens(fm.target, patch_size)
    return pred, partial(flow_matching_loss, fm, target[:, context_parallel_part(target.shape[1], cp, rank)], rank == 0)


def flow_matching_loss(batch: FlowMatchBatch, target: torch.Tensor | None, counts: bool, pred: torch.Tensor):
    """(sum of the samples' weighted MSE, sample count, {LOSS_KEY: [sum, count]}). ``target``: what
    ``pred`` predicts when not the whole of ``batch.target`` (this CP rank's tokens); ``counts``: whether this rank counts the
    samples (one rank per CP group)."""
    per_sample = FlowMatching.per_sample_loss(pred, batch, target=target)
    total = per_sample.sum()
    n = torch.tensor(per_sample.numel() if counts else 0, device=pred.device)
    return total, n.to(torch.int), {LOSS_KEY: torch.stack([total.detach(), n.float()])}


@dataclass
class DiffusionModel:
    """A ``loong_models.ModelConfig`` with ``diffusion`` set: the Wan DiT and its objective."""

    cfg: ModelConfig
    backend: str
    seed: int = 0

    @classmethod
    def from_config(cls, cfg: ModelConfig, device_type: str, *, seed: int = 0) -> DiffusionModel:
        return cls(cfg, resolve_backend(cfg.layer_backend, device_type), seed)

    def transformer_config(self, parallel: ParallelConfig, *, dtype: torch.dtype, device_type: str
                           ) -> TransformerConfig:  # fmt: skip
        """The runtime's fields (precision, layout); the DiT derives its own sizes from them."""
        if parallel.pp > 1:
            raise ValueError("a diffusion model trains with TP (and sequence parallelism) and DP: parallel.pp=1")
        return build_transformer_config(self.cfg.foundation,
                                        **runtime_transformer_fields(parallel, dtype=dtype, device_type=device_type),
                                        **fusion_fields(self.backend))  # fmt: skip

    def provider(self, config: TransformerConfig, parallel: ParallelConfig, *, device_type: str) -> ModelProvider:
        def build(pre_process: bool, post_process: bool, vp_stage: int | None) -> torch.nn.Module:
            return build_model(self.cfg, config, device_type=device_type, layer_backend=self.backend)

        return build

    def forward_step(self, device: torch.device) -> Callable:
        objective = FlowMatching(self.cfg.flow_matching or FlowMatchingConfig())
        return partial(diffusion_forward_step, device, objective, self.seed, list(self.cfg.diffusion.patch_size))

    def flops(self, counts, *, seq_length: int) -> float:
        """The step's latent tokens in samples of ``seq_length`` tokens (data.seq_length)."""
        return counts.tokens * self.cfg.diffusion.flops_per_token(seq_length)

    def cost_shape(self) -> dict[str, int]:
        d = self.cfg.diffusion
        return dict(num_parameters=d.num_parameters(), num_layers=d.num_layers, attention_width=d.dim)

    def step_stats(self, chunks, config, device) -> None:
        return None

    def describe(self) -> str:
        d = self.cfg.diffusion
        return (f"wan DiT ({d.num_parameters() / 1e6:.2f}M params, {d.num_layers} layers, dim {d.dim}, "
                f"{d.num_attention_heads} heads)")  # fmt: skip
