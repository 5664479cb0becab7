"""Model kinds: what a training run needs from a kind of model, behind one interface.

The trainer builds, steps and measures any :class:`ModelKind` the same way; what differs between
kinds (the forward step and its inputs, the FLOP count, the transformer config) lives here, never
in the loop. :class:`LanguageModel` covers the zoo's models (GPT LLMs, MoE, VLMs); a new kind (a
DiT, a VLA) is a class with the same methods, passed to the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch
from megatron.core import parallel_state as mpu
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_models import ModelConfig, build_model, build_transformer_config, fusion_fields, resolve_backend
from loong_models.flops import Work
from loong_models.precision import load_policy, precision_fields
from loong_models.specs import attention_backend_fields
from loong_parallel.component_groups import image_encoder_process_groups
from loong_parallel.config import ParallelConfig
from loong_parallel.encoder_layout import apply_encoder_layout, encoder_on_every_stage, vision_shape
from loong_parallel.forward import lm_forward_step
from loong_parallel.model import ModelProvider
from loong_parallel.moe import RouterStats
from loong_parallel.mtp import MTPStats
from loong_parallel.runtime import runtime_transformer_fields


class StepCounts(Protocol):
    """What a step consumed, as its data counts it (loong_data.StepCounts)."""

    tokens: int
    token_pairs: int | None  # sum over samples of length**2; None: rows of data.seq_length
    grids: tuple[tuple[int, int, int], ...]  # (t, h, w) patch grids of its images and videos


@dataclass
class StepStats:
    """The model's statistics for the log (router loads, MTP loss): each part's, in one record."""

    parts: list[RouterStats | MTPStats]

    def report(self, microbatches: int, step: int) -> dict[str, float | list[int]]:
        """Collective over all ranks, like each part's."""
        return {k: v for p in self.parts for k, v in p.report(microbatches, step).items()}

    def close(self) -> None:
        for p in self.parts:
            p.close()


class ModelKind(Protocol):
    """What the trainer asks of a model: build it, step it, count its work."""

    backend: str  # the resolved layer backend (for the log)

    def transformer_config(self, parallel: ParallelConfig, *, dtype: torch.dtype, device_type: str
                           ) -> TransformerConfig: ...  # fmt: skip

    def provider(self, config: TransformerConfig, parallel: ParallelConfig, *, device_type: str
                 ) -> ModelProvider: ...  # fmt: skip

    def forward_step(self, device: torch.device) -> Callable:
        """megatron's ``forward_step_func(data_iterator, model, return_schedule_plan=False)``."""

    def flops(self, counts: StepCounts, *, seq_length: int) -> float:
        """Training FLOPs of what a step consumed (its data's counts, summed over the DP group)."""

    def cost_shape(self) -> dict[str, int]:
        """``num_parameters``, ``num_layers``, ``attention_width``: the balancer's cost model
        (a VLM adds its vision tower's, see :func:`loong_parallel.encoder_layout.vision_shape`)."""

    def step_stats(self, chunks: list[torch.nn.Module], config: TransformerConfig, device: torch.device
                   ) -> StepStats | None: ...  # fmt: skip

    def describe(self) -> str: ...


@dataclass
class LanguageModel:
    """The zoo's models (``loong_models.ModelConfig``): GPT LLMs (dense or MoE) and VLMs."""

    cfg: ModelConfig
    backend: str
    # tokens one GEMM sees per micro-batch (seq_length x micro-batch / cp): adaptive FP8's lookup key
    tokens_per_microbatch: int | None = None

    @classmethod
    def from_config(cls, cfg: ModelConfig, device_type: str, *, tokens_per_microbatch: int | None = None
                    ) -> LanguageModel:  # fmt: skip
        """Resolves the layer backend, once for every component."""
        return cls(cfg, resolve_backend(cfg.layer_backend, device_type), tokens_per_microbatch)

    def transformer_config(self, parallel: ParallelConfig, *, dtype: torch.dtype, device_type: str
                           ) -> TransformerConfig:  # fmt: skip
        """The foundation's config; the layout and layer backend decide the rest (CUDA-only
        options, grouped-GEMM experts)."""
        fused_mlp, precision = self.mlp_and_precision(parallel)
        return build_transformer_config(self.cfg.foundation,
                                        **runtime_transformer_fields(parallel, dtype=dtype, device_type=device_type),
                                        **fusion_fields(self.backend, bias_dropout_add=self.cfg.fuse_bias_dropout_add,
                                                        bias_activation=self.cfg.fuse_bias_activation,
                                                        fused_mlp=fused_mlp, fused_qkv_rope=self.cfg.fused_qkv_rope),
                                        **precision, **attention_backend_fields(self.cfg.attention_backend))  # fmt: skip

    def mlp_and_precision(self, parallel: ParallelConfig) -> tuple[bool, dict]:
        """Whether the MLPs may be TE's op fuser (``model.fused_mlp``), and the FP8 fields. Decided
        together: adaptive FP8 whose policy picks BF16 for every GEMM kind sets no FP8 field, and
        then the model is the BF16 default one, op-fuser MLP included (adaptive is never slower)."""
        precision = self._precision_fields(parallel)
        return self.cfg.uses_fused_mlp(adaptive_runs_fp8=bool(precision)), precision

    def _precision_fields(self, parallel: ParallelConfig) -> dict:
        """The foundation's FP8 fields; adaptive decides per GEMM kind at this run's TP size and tokens."""
        f = self.cfg.foundation
        pcfg = f.precision
        if pcfg.fp8 == "adaptive" and pcfg.num_tokens is None and self.tokens_per_microbatch is None:
            raise ValueError("model.foundation.precision.fp8=adaptive: set model.foundation.precision.num_tokens "
                             "(no run shape to derive it from)")  # fmt: skip
        policy = load_policy(pcfg.policy) if pcfg.fp8 == "adaptive" else None
        return precision_fields(pcfg, policy, gemms=f.gemm_kinds(), tp=parallel.tp,
                                tokens=pcfg.num_tokens or self.tokens_per_microbatch or 0,
                                router_topk=f.moe.router_topk if f.moe else 1, prefix="model.foundation")  # fmt: skip

    def provider(self, config: TransformerConfig, parallel: ParallelConfig, *, device_type: str) -> ModelProvider:
        """Collective: a VLM's image encoder may get its own process groups."""
        groups = image_encoder_process_groups(self.cfg, parallel.tp)

        def build(pre_process: bool, post_process: bool, vp_stage: int | None) -> torch.nn.Module:
            model = build_model(self.cfg, config, device_type=device_type, pre_process=pre_process,
                                post_process=post_process, vp_stage=vp_stage, encoder_pg_collection=groups,
                                layer_backend=self.backend,
                                encoder_on_every_stage=encoder_on_every_stage(parallel.encoder_layout))  # fmt: skip
            return apply_encoder_layout(model, parallel.encoder_layout, self.cfg, mpu.get_tensor_model_parallel_group())

        return build

    def forward_step(self, device: torch.device) -> Callable:
        return partial(lm_forward_step, device)

    def flops(self, counts: StepCounts, *, seq_length: int) -> float:
        """loong_models' count: each sample's attention over its real tokens, the ViT's per frame
        and window."""
        pairs = counts.tokens * seq_length if counts.token_pairs is None else counts.token_pairs
        work = Work(tokens=counts.tokens, token_pairs=pairs) + self.cfg.work(grids=counts.grids)
        return self.cfg.training_flops(work)

    def cost_shape(self) -> dict[str, int]:
        """The LLM's shape, and a VLM's vision tower (the multimodal balancer counts patches)."""
        f = self.cfg.foundation
        shape = dict(num_parameters=f.num_active_parameters(), num_layers=f.num_layers,
                     attention_width=f.num_attention_heads * f.head_dim)  # fmt: skip
        if self.cfg.is_multimodal:
            shape.update(vision_shape(self.cfg))
        return shape

    def step_stats(self, chunks: list[torch.nn.Module], config: TransformerConfig, device: torch.device
                   ) -> StepStats | None:  # fmt: skip
        """MoE models report their routers' statistics, models with MTP layers their MTP loss."""
        f = self.cfg.foundation
        parts = [*([RouterStats(chunks, config, device)] if f.moe else []),
                 *([MTPStats(config, device)] if f.mtp_num_layers else [])]  # fmt: skip
        return StepStats(parts) if parts else None

    def describe(self) -> str:
        f, m = self.cfg.foundation, self.cfg
        n_params, n_active = f.num_parameters(), f.num_active_parameters()
        moe = f"{n_active / 1e6:.1f}M active, {f.moe.num_experts} experts top-{f.moe.router_topk}, " if f.moe else ""
        vision = ""
        if m.is_multimodal:
            vision = f"; + {(m.num_parameters() - n_params) / 1e6:.2f}M image encoder + projector"
        lora = f" | LoRA rank {m.lora.rank} on {', '.join(m.lora.targets)}" if m.lora else ""
        return f"{f.family} ({n_params / 1e6:.1f}M params, {moe}{f.num_layers} layers{vision}){lora}"

