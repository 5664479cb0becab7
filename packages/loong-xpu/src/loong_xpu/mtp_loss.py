"""megatron's multi-token-prediction (MTP) loss with context parallelism, counted over whole sequences.

With ``calculate_per_token_loss`` (Loong's convention) megatron's ``process_mtp_loss`` weights
each MTP layer's summed loss by ``tokens / rolled tokens`` of the micro-batch: the LM loss's token
count over the count left after the layer's shift (the last token of every sequence has no next
label). Under context parallelism both counts are the CP rank's own share, so the ranks weight
their halves of one sequence differently (the rank that holds the sequence's end loses a token,
the others none), and a rank whose own tokens carry no loss drops the loss of the token it
receives from its neighbour. The gradient then differs from one process's.

:func:`make_process_mtp_loss` keeps megatron's function for everything but CP with per-token
loss, where it runs the same steps (megatron's ``roll_tensor`` across CP ranks, its loss,
acceptance counts, tracker and ``MTPLossAutoScaler``) with both counts summed over the CP group:
the whole sequences' counts, as one process sees them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist


def make_process_mtp_loss(accel: object = None):
    """The ``process_mtp_loss`` that ``megatron.core.models.gpt.gpt_model`` calls (keyword args)."""
    from megatron.core.transformer import multi_token_prediction as mtp

    original = mtp.process_mtp_loss

    @functools.wraps(original)
    def process_mtp_loss(**kw: Any) -> torch.Tensor:
        cp = kw.get("cp_group")
        if cp is None or cp.size() == 1 or kw.get("labels") is None or not kw["config"].calculate_per_token_loss:
            return original(**kw)
        return _whole_sequence_mtp_loss(**kw)

    return process_mtp_loss


def _cp_sum(count: torch.Tensor, group) -> torch.Tensor:
    total = count.detach().float().clone()
    dist.all_reduce(total, group=group)
    return total


def _whole_sequence_mtp_loss(hidden_states, labels, loss_mask, output_layer, output_weight, runtime_gather_output,
                             is_training, compute_language_model_loss, config, cp_group, tp_group=None,
                             packed_seq_params=None, scale_logits_fn=None, input_ids=None) -> torch.Tensor:  # fmt: skip
    """megatron's process_mtp_loss (labels given, per-token loss) with the CP group's counts."""
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_token_prediction as mtp

    layers = config.mtp_num_layers
    chunks = torch.chunk(hidden_states, 1 + layers, dim=0)
    if config.mtp_detach_heads:
        output_weight = (output_weight if output_weight is not None else output_layer.weight).detach()
    mask = torch.ones_like(labels) if loss_mask is None else loss_mask
    tokens = _cp_sum(mask.sum(), cp_group)  # the LM loss's tokens in the whole sequences
    roll = functools.partial(mtp.roll_tensor, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
    hidden = chunks[0]
    for layer in range(layers):
        logits, _ = output_layer(chunks[layer + 1], weight=output_weight, runtime_gather_output=runtime_gather_output)
        if scale_logits_fn is not None:
            logits = scale_logits_fn(logits)
        labels, _ = roll(labels)
        mask, _ = roll(mask)
        rolled = _cp_sum(mask.sum(), cp_group).clamp(min=1)
        loss = mask * compute_language_model_loss(labels, logits)
        if is_training:
            correct, total = mtp._compute_mtp_acceptance_counts(logits, labels, mask, output_layer,
                                                                runtime_gather_output, tp_group)  # fmt: skip
            # the tracker averages over DP x CP ranks: each logs cp x its share of the sequences' mean
            mtp.MTPLossLoggingHelper.save_metrics_to_tracker(
                loss.sum() * cp_group.size() / rolled, correct, total, layer, layers,
                avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
            )
        scale = config.mtp_loss_scaling_factor / layers
        hidden = mtp.MTPLossAutoScaler.apply(hidden, scale * loss * (tokens / rolled))
    return hidden
