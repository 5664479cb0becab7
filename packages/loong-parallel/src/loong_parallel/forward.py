"""The language-model forward step in megatron's ``forward_step_func`` protocol: per-token LM
loss on the last stage, hidden states elsewhere. One function for GPT models and VLMs: what
differs (packed sequences, images) is carried by the micro-batch."""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state as mpu

from loong_models.omni import HOST_MEDIA_KEYS, MEDIA_KEYS
from loong_models.packed_seq import packed_seq_params
from loong_parallel.context_parallel import context_parallel_index, split_for_context_parallel
from loong_parallel.step import LOSS_KEY


def lm_forward_step(device: torch.device, data_iterator, model, return_schedule_plan: bool = False):
    """With context parallelism each rank takes its load-balanced share of the micro-batch.
    Packed (THD) batches carry ``cu_seqlens``: attention stays inside each document. Multimodal
    batches also carry images / videos (``MEDIA_KEYS``), which go to the model as keywords.
    ``return_schedule_plan``: megatron's combined 1F1B schedule (MoE all-to-all overlap) asks for
    the model's schedule plan of this micro-batch instead of running its forward. The batch comes
    from the host (pinned by the data when the device is CUDA, so every copy is asynchronous)."""
    full = next(data_iterator)
    cp, cp_index = mpu.get_context_parallel_world_size(), None
    if cp > 1:
        cp_index = context_parallel_index(full, cp, mpu.get_context_parallel_rank())
    batch = split_for_context_parallel(full, cp, mpu.get_context_parallel_rank(), cp_index)
    tokens = batch["tokens"].to(device, non_blocking=True)
    packed = None
    if "cu_seqlens" in batch:
        cu = batch["cu_seqlens"]  # on the host, and its boundaries for attention that splits by segment
        packed = packed_seq_params(cu.to(device, non_blocking=True), batch["max_seqlen"], bounds=cu.tolist())
    media = vlm_inputs(batch, device, full_tokens=full["tokens"], cp_index=cp_index)
    run = model.build_schedule_plan if return_schedule_plan else model
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    output = run(
        tokens,
        batch["position_ids"].to(device, non_blocking=True),
        None,  # causal mask is implied by the layer spec
        labels=batch["labels"].to(device, non_blocking=True),
        packed_seq_params=packed,
        loss_mask=loss_mask,  # megatron's MTP loss (if any) masks the same tokens as the LM loss
        **media,
    )
    return output, partial(masked_token_loss, loss_mask)


def vlm_inputs(batch: dict, device: torch.device, *, full_tokens: torch.Tensor | None = None,
               cp_index: torch.Tensor | None = None) -> dict:  # fmt: skip
    """A multimodal micro-batch's keywords for OmniCombinationModel: pixels on the device; grids
    and token ids on the host (segment boundaries: in the packed parameters), where the model's
    bookkeeping (positions, placeholders, ViT segments and windows) reads them without waiting
    for the device. Nothing for a text batch (no media keys). With context parallelism
    (``cp_index``: the positions of this rank's tokens) the host ids are the whole sequence's
    (``full_tokens``): the model encodes every image of the micro-batch, computes the positions
    on the whole sequence and keeps this rank's tokens of both."""
    if not any(key in batch for key in MEDIA_KEYS):
        return {}
    media = {key: batch[key] if key in HOST_MEDIA_KEYS else batch[key].to(device, non_blocking=True)
             for key in MEDIA_KEYS if key in batch and batch[key].numel()}  # a pack without images: empty  # fmt: skip
    media["host_input_ids"] = batch["tokens"] if cp_index is None else full_tokens
    if cp_index is not None:
        media["cp_index"] = cp_index
    return media


def masked_token_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """megatron's loss_func with ``calculate_per_token_loss``: (sum, count, {LOSS_KEY: [sum, count]})."""
    mask = loss_mask.reshape(-1).float()
    loss_sum = (per_token_loss.reshape(-1).float() * mask).sum()
    num_tokens = mask.sum()
    return loss_sum, num_tokens.to(torch.int), {LOSS_KEY: torch.stack([loss_sum.detach(), num_tokens])}
