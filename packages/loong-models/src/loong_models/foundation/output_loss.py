"""How the foundation's output layer computes the LM loss (``model.foundation.output_loss``).

``megatron``: megatron's path: the output layer writes the ``[tokens, vocab]`` logits, megatron's
(TE-fused) vocab-parallel cross-entropy reads them. ``fused``: the final hidden states and the
output weight (the tied embedding's, or the output layer's) go to
:func:`loong_kernels.linear_cross_entropy_per_token`, which never holds more than one chunk of
logits and returns the same per-token losses ``[b, s]`` for megatron's loss path (the train
app's loss mask and token averaging unchanged). Its gradients come from the forward, for losses
reduced as ``c * sum(loss_mask * loss)`` (what ``loong_parallel.masked_token_loss`` and
megatron's schedules do, loss scale included); the loss mask therefore goes to the forward, as
``lm_forward_step`` passes it.

``model.foundation.precision.fp8_output_layer``: the same loss with the output layer's GEMMs in
FP8 (``linear_cross_entropy_per_token(fp8=True)``).

The hook is megatron's own ``output_processor`` of ``GPTModel._postprocess``, installed by
:class:`FusedLossGPTModel` whenever labels are given (forward and the combined-1F1B schedule plan).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_kernels import linear_cross_entropy_per_token
from loong_models.choices import OutputLoss

__all__ = ["FusedLossGPTModel", "OutputLoss", "fused_loss_blockers", "fused_output_loss"]


def fused_loss_blockers(config: TransformerConfig) -> dict[str, bool]:
    """What the fused loss cannot run with, by the megatron field that enables it (the train app
    names its own keys for the same conditions)."""
    return {
        "tensor parallelism (vocab-parallel output layer)": config.tensor_model_parallel_size > 1,
        "sequence parallelism": bool(config.sequence_parallel),
        "multi-token prediction (mtp_num_layers)": bool(config.mtp_num_layers),
        "MuP logit scaling (use_mup)": bool(getattr(config, "use_mup", False)),
        "deferred embedding wgrad (defer_embedding_wgrad_compute)": bool(
            config.defer_embedding_wgrad_compute
        ),
    }


def fused_output_loss(
    *,
    hidden_states: torch.Tensor,
    output_layer: torch.nn.Module,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None,
    fp8: bool = False,
    chunk_size: int | None = None,
    **_: Any,
) -> torch.Tensor:
    """megatron's ``output_processor`` contract: hidden states ``[s, b, h]`` (THD: ``[t, 1, h]``),
    labels and loss mask ``[b, s]`` -> per-token losses ``[b, s]``, float32. ``fp8``: the GEMMs
    in FP8; ``chunk_size``: tokens per chunk of logits (None: the kernel's default)."""
    weight = output_weight if output_weight is not None else output_layer.weight
    # [s, b] order, as the hidden states
    target = labels.transpose(0, 1)
    mask = torch.ones_like(target, dtype=torch.float32) if loss_mask is None else loss_mask.transpose(0, 1)
    losses = linear_cross_entropy_per_token(hidden_states.to(weight.dtype), weight, target, mask, chunk_size, fp8=fp8)
    return losses.transpose(0, 1).contiguous()


class FusedLossGPTModel(GPTModel):
    """megatron's GPTModel whose last stage computes the LM loss with :func:`fused_output_loss`
    when labels are given (logits are still returned without labels, e.g. for generation).
    ``fp8_output_layer``: its GEMMs in FP8; ``chunk_tokens``: tokens per chunk of logits."""

    def __init__(self, *args: Any, fp8_output_layer: bool = False, chunk_tokens: int | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.fp8_output_layer = fp8_output_layer
        self.chunk_tokens = chunk_tokens
        blocked = [what for what, present in fused_loss_blockers(self.config).items() if present]
        if blocked:
            raise ValueError(f"model.foundation.output_loss=fused cannot run with {', '.join(blocked)}; "
                             "use output_loss=megatron")  # fmt: skip

    def _postprocess(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        # megatron calls it with keywords only (forward and the schedule plan's post-process node)
        if kwargs.get("labels") is not None and kwargs.get("output_processor") is None:
            kwargs["output_processor"] = functools.partial(fused_output_loss, fp8=self.fp8_output_layer,
                                                           chunk_size=self.chunk_tokens)
        return super()._postprocess(*args, **kwargs)
