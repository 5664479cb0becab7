"""megatron's multi-latent attention (MLA) under tensor parallelism, with the shared RoPE key's
gradient summed over the TP ranks.

MLA's kv down projection yields, per token, the latent ``kv_compressed`` and one RoPE key part
``k_pe`` that every attention head shares. Each TP rank expands ``k_pe`` over its own heads only,
so the gradient each rank computes for ``k_pe`` holds its heads' share; the shares must be summed
over the TP group. megatron sums them in one case only: a duplicated down projection (TE's
``TELinear``) under sequence parallelism, where ``k_pe`` is all-gathered over the sequence and its
gradient reduce-scattered. Otherwise the gradient stays partial (megatron-core issue #1699):

- without sequence parallelism ``k_pe`` is used as it is (any down projection);
- with a column-parallel down projection (the local backend's ``ColumnParallelLinear``) megatron
  all-gathers the output's columns, whose gradient is split back, not summed (with or without SP).

The latent's gradient is complete on every rank either way: it passes the column-parallel up
projection, whose input gradient is all-reduced (or reduce-scattered under SP).

:func:`make_qkv_down_projection` wraps ``MLASelfAttention._qkv_down_projection`` so that the
``kv_combined`` it returns is the full width, which makes megatron's forward take its
duplicated-projection path: a column-parallel output is all-gathered here (and cut back to this
rank's sequence part under SP, where megatron then all-gathers ``k_pe`` and reduce-scatters its
gradient), and without SP ``k_pe`` passes ``copy_to_tensor_model_parallel_region`` (identity
forward, all-reduce backward). The forward values are unchanged.
"""

from __future__ import annotations

import functools

import torch


def make_qkv_down_projection(accel: object = None):
    """The ``_qkv_down_projection`` method that ``MLASelfAttention`` calls in its forward."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    original = MLASelfAttention._qkv_down_projection

    @functools.wraps(original)
    def _qkv_down_projection(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_compressed, kv_combined = original(self, hidden_states)
        return q_compressed, shared_rope_key_summed_over_tp(kv_combined, self.config, self.tp_group)

    return _qkv_down_projection


def make_absorbed_mla_init(accel: object = None):
    """``AbsorbedMLASelfAttention.__init__`` (DeepSeek sparse attention's MLA), then a forward hook on
    its kv down projection that does what :func:`make_qkv_down_projection` does for
    ``MLASelfAttention``: megatron inlines that projection in ``get_query_key_value_tensors``, and
    with the local backend's column-parallel projection it gathers the output's columns and keeps
    ``k_pe`` whole, so its gradient holds this rank's heads' share only. The hook hands megatron the
    full-width output cut to this rank's sequence part (AbsorbedMLA requires sequence parallelism
    under TP): megatron then all-gathers ``k_pe`` itself and reduce-scatters, i.e. sums, its gradient."""
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import AbsorbedMLASelfAttention

    original = AbsorbedMLASelfAttention.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        if self.tp_group is not None and self.tp_group.size() > 1:
            hook = functools.partial(_full_width_kv_combined, config=self.config, tp_group=self.tp_group)
            self.linear_kv_down_proj.register_forward_hook(hook)

    return __init__


def _full_width_kv_combined(module, args, output, *, config, tp_group):  # noqa: ANN001, ANN202 (a forward hook)
    kv_combined, bias = output
    return shared_rope_key_summed_over_tp(kv_combined, config, tp_group), bias


def shared_rope_key_summed_over_tp(kv_combined: torch.Tensor, config, tp_group) -> torch.Tensor:
    """``kv_combined`` ([s(/TP), b, kv_lora_rank + qk_pos_emb_head_dim], or this rank's columns of
    it from a column-parallel projection) with the RoPE key's gradient summed over ``tp_group``."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
        scatter_to_sequence_parallel_region,
    )

    if tp_group is None or tp_group.size() == 1:
        return kv_combined
    widths = [config.kv_lora_rank, config.qk_pos_emb_head_dim]
    if kv_combined.size(-1) != sum(widths):  # column-parallel: this rank's columns, every token
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=tp_group)
        if config.sequence_parallel:  # megatron all-gathers k_pe from the sequence parts
            return scatter_to_sequence_parallel_region(kv_combined, group=tp_group)
    if config.sequence_parallel:
        return kv_combined
    latent, k_pe = torch.split(kv_combined, widths, dim=-1)
    return torch.cat([latent, copy_to_tensor_model_parallel_region(k_pe, group=tp_group)], dim=-1)
