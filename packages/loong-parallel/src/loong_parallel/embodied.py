"""The embodied model kind: a Pi0.5 policy (``loong_models.embodied``) as the trainer runs it.

The policy is a plain ``nn.Module``; megatron-core contributes what it is good at here, the DDP
wrapper (bucketed, overlappable gradient reduction) and the distributed optimizer (ZeRO-1),
which ``build_model_chunks`` / ``build_optimizer`` put around it as around any chunk. No tensor or
pipeline parallelism: the policy is data-parallel only (design: models < 10B).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_models import ModelConfig
from loong_models.embodied import Pi05Config, Pi05Policy
from loong_parallel.config import ParallelConfig
from loong_parallel.model import ModelProvider
from loong_parallel.runtime import runtime_transformer_fields
from loong_parallel.step import LOSS_KEY

HOST_KEYS = ("sample_ids", "action_dim_mask")


def policy_forward_step(device: torch.device, data_iterator, model, return_schedule_plan: bool = False):
    """megatron's ``forward_step_func``: the flow-matching loss summed over the micro-batch's
    samples, chunk steps and real action dims, with its element count (the global mean then
    weighs every element the same whatever the DP or micro-batch split)."""
    # a new iteration for the CUDA graphs of compiled layers (model.embodied.compile_mode=
    # reduce-overhead): the previous micro-batch's backward has run, its graphs' outputs are dead
    torch.compiler.cudagraph_mark_step_begin()
    # the policy reads the sample ids and the action-dim mask on the host: they stay there
    batch = {
        k: v if k in HOST_KEYS else v.to(device, non_blocking=True) for k, v in next(data_iterator).items()
    }
    # bf16 weights (train.dtype=bf16) meet fp32 frames, noisy actions and time embeddings: autocast
    # runs each matmul in the weights' dtype (megatron's Float16Module casts only positional inputs)
    dtype = next(model.parameters()).dtype
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss_sum, count = model(batch, reduction="sum")
    return loss_sum, partial(_flow_loss, count)


def _flow_loss(count: int, loss_sum: torch.Tensor):
    # filled on the device, not copied from the host: a blocking host-to-device copy here would
    # stall the host until the forward has run, before it may queue the backward
    n = torch.full((), count, dtype=torch.int, device=loss_sum.device)
    return loss_sum, n, {LOSS_KEY: torch.stack([loss_sum.detach().float(), n.float()])}


@dataclass
class EmbodiedPolicy:
    """``model.embodied`` (Pi0.5): the methods of :class:`loong_parallel.ModelKind`."""

    cfg: Pi05Config
    backend: str = "torch (plain nn.Module)"

    def transformer_config(
        self, parallel: ParallelConfig, *, dtype: torch.dtype, device_type: str
    ) -> TransformerConfig:
        """The config megatron's DDP, optimizer and schedules read (sizes for their bookkeeping
        only; the policy's layers are its own)."""
        if parallel.tp != 1 or parallel.pp != 1 or parallel.ep != 1 or parallel.vpp:
            raise ValueError(
                "an embodied policy is data-parallel only: set parallel.tp, pp and ep to 1, vpp to null"
            )
        v = self.cfg.vlm
        fields = runtime_transformer_fields(parallel, dtype=dtype, device_type=device_type)
        # Every micro-batch holds the same number of loss elements (micro_batch_size x chunk_size x
        # the dataset's action dims), so the mean of the micro-batch means that megatron forms
        # without per-token loss is the global per-element mean. It scales each micro-batch's loss
        # before its backward instead of the whole fp32 gradient buffer after it (a full pass over
        # 3.35B fp32 gradients per step at the full shape, ~18 ms on an H100).
        fields["calculate_per_token_loss"] = False
        return TransformerConfig(
            num_layers=v.depth, hidden_size=v.width, num_attention_heads=v.num_heads, **fields
        )

    def provider(
        self, config: TransformerConfig, parallel: ParallelConfig, *, device_type: str
    ) -> ModelProvider:
        def build(pre_process: bool, post_process: bool, vp_stage: int | None) -> torch.nn.Module:
            policy = Pi05Policy(self.cfg).to(config.params_dtype)
            policy.config = config  # megatron's DDP and schedules read the model's config and type
            policy.model_type = ModelType.encoder_or_decoder
            return policy

        return build

    def forward_step(self, device: torch.device) -> Callable:
        return partial(policy_forward_step, device)

    def flops(self, counts, *, seq_length: int) -> float:
        """6 N per token (forward + backward), N without the embedding table; the vision tower's
        work per image is not counted (its patches are not in ``counts.tokens``)."""
        return 6.0 * (self.cfg.num_parameters() - self.cfg.vocab_size * self.cfg.vlm.width) * counts.tokens

    def cost_shape(self) -> dict[str, int]:
        v = self.cfg.vlm
        return dict(
            num_parameters=self.cfg.num_parameters(),
            num_layers=v.depth,
            attention_width=v.num_heads * v.head_dim,
        )

    def step_stats(self, chunks, config, device) -> None:
        return None

    def describe(self) -> str:
        c = self.cfg
        return (f"pi05 ({c.num_parameters() / 1e6:.2f}M params: SigLIP {c.vision.num_layers}x{c.vision.hidden_size}, "
                f"Gemma {c.vlm.depth}x{c.vlm.width} + expert {c.expert.width}, horizon {c.chunk_size})")  # fmt: skip


def model_kind(cfg: ModelConfig, device_type: str, *, seed: int = 0, tokens_per_microbatch: int | None = None):
    """The kind that trains ``cfg``: an embodied policy, a diffusion transformer (``seed``: its
    noise), else the zoo's language models (``tokens_per_microbatch``: adaptive FP8's key)."""
    from loong_parallel.diffusion import DiffusionModel
    from loong_parallel.kinds import LanguageModel

    if cfg.embodied is not None:
        return EmbodiedPolicy(cfg.embodied)
    if cfg.diffusion is not None:
        return DiffusionModel.from_config(cfg, device_type, seed=seed)
    return LanguageModel.from_config(cfg, device_type, tokens_per_microbatch=tokens_per_microbatch)
