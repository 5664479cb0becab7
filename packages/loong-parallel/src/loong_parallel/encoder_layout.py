"""Where a VLM's image encoder runs: ``parallel.encoder_layout``.

- ``shared``: every rank of a foundation TP group encodes every image of its micro-batch (the
  encoder at TP=1 is replicated, so that work is repeated TP times).
- ``hetero_dp``: the encoder at TP=1 is a data-parallel replica on every rank of the TP group.
  The images (and video clips) of a micro-batch are split over the TP ranks by their ViT cost
  (LPT, the same plan on every rank), each rank encodes and projects its share, and a
  variable-length all-gather (:class:`GatherVisionTokens`) rebuilds every image's tokens on every
  rank. The tokens' gradient arrives TP-replicated (the first layer's column-parallel linear
  all-reduces its input gradient; with sequence parallelism the scatter's backward all-gathers
  it), so each rank keeps its own rows. The encoder's parameter gradients are then partial sums
  over TP ranks; megatron's ``finalize_model_grads`` averages replicated parameters over TP
  (``average_gradients_across_tp_domain``), so the backward scales the kept rows by TP and the
  average is the sum: the single-process gradient, exact for power-of-two TP.
- ``decoupled`` (PP > 1): the images of all micro-batches of a step are split over every TP x PP
  rank, encoded before megatron's schedule, sent to the first stage, and their gradient sent back
  after it (:mod:`loong_parallel.encoder_decoupled`). The encoder lives on every stage.

The layout is applied to a built model from outside (:func:`apply_encoder_layout`), the model
only asks its ``vision_encode`` hook for the embeddings.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from loong_parallel.balance import MultimodalCost, QuadraticCost, split_media
from loong_parallel.config import EncoderLayout


class GatherVisionTokens(torch.autograd.Function):
    """Forward: every rank's ``[n_r, H]`` rows, all-gathered in rank order (``counts`` known to
    all ranks, so no size exchange; rows padded to the largest count). Backward: this rank's rows
    of the (TP-replicated) gradient, times ``scale``."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], rank: int, group, scale: float) -> torch.Tensor:
        ctx.offset, ctx.count, ctx.scale = sum(counts[:rank]), counts[rank], scale
        width = max(counts)
        padded = local.new_zeros(width, *local.shape[1:])
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mine = grad[ctx.offset : ctx.offset + ctx.count]
        return mine * ctx.scale, None, None, None, None


class HeteroDPEncode:
    """``(model, pixel_values, grid_thw) -> [tokens, hidden]`` in input order, each image encoded
    on one rank of ``group`` (the foundation's TP group)."""

    def __init__(self, group, cost: Callable) -> None:
        self.group, self.cost = group, cost
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def __call__(self, model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = [tuple(int(x) for x in g) for g in grid_thw.tolist()]
        owner = split_media(grids, self.size, self.cost)
        patches = [t * h * w for t, h, w in grids]
        starts = np.concatenate([[0], np.cumsum(patches)])
        unit = model.spatial_merge_size**2
        mine = [i for i in range(len(grids)) if owner[i] == self.rank]
        counts = [sum(patches[i] for i in range(len(grids)) if owner[i] == r) // unit for r in range(self.size)]
        if mine:
            rows = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in mine]).to(pixel_values.device)
            local = model.image_projector(model.image_encoder(pixel_values[rows], grid_thw[mine]))
        else:  # nothing to encode here: zero rows join the gather
            out = model.image_projector.mlp.linear_fc2.weight
            local = torch.zeros(0, out.shape[0], dtype=out.dtype, device=pixel_values.device)
        gathered = GatherVisionTokens.apply(local, counts, self.rank, self.group, float(self.size))
        # gathered rows are in rank order; put every item's tokens back in input order
        order, offsets = [], {r: sum(counts[:r]) for r in range(self.size)}
        for i in range(len(grids)):
            n = patches[i] // unit
            order.append(torch.arange(offsets[int(owner[i])], offsets[int(owner[i])] + n))
            offsets[int(owner[i])] += n
        return gathered[torch.cat(order).to(gathered.device)]


def vision_shape(model_cfg) -> dict[str, int]:
    """A VLM's vision tower as :meth:`MultimodalCost.from_flops` takes it (``model_cfg``: a
    ``loong_models.ModelConfig``): ViT + projector parameters, layers, full-attention layers,
    attention width, patches per attention window."""
    from loong_models.image_encoder.config import get_encoder_type

    e, f = model_cfg.image_encoder, model_cfg.foundation
    windows = get_encoder_type(e.type).windows
    proj = model_cfg.image_projector.num_parameters(e.hidden_size, e.spatial_merge_size, f.hidden_size)
    return dict(vision_parameters=e.num_parameters() + proj, vision_layers=e.num_layers,
                full_attention_layers=len(e.fullatt_block_indexes) if windows else e.num_layers,
                vision_width=e.num_attention_heads * e.head_dim,
                window_patches=(e.window_size // e.patch_size) ** 2 if windows else 0)  # fmt: skip


def vision_cost(model_cfg) -> MultimodalCost:
    """FLOP cost of the vision tower alone (no LLM term): what splitting images balances."""
    return MultimodalCost.from_flops(QuadraticCost(1.0, 0.0), **vision_shape(model_cfg))


def encoder_layout_errors(layout: str, model_cfg, tp: int) -> list[str]:
    """``hetero_dp`` and ``decoupled`` need a VLM whose encoder is replicated (TP=1) on every rank
    that encodes (the group sizes are ParallelConfig.validate's)."""
    if layout == EncoderLayout.shared:
        return []
    if model_cfg.image_encoder is None:
        return [f"parallel.encoder_layout={layout} needs a VLM (model.image_encoder is null)"]
    etp = model_cfg.image_encoder.tensor_model_parallel_size
    if etp != 1 and not (etp is None and tp == 1):
        return [f"parallel.encoder_layout={layout} needs model.image_encoder.tensor_model_parallel_size=1 "
                f"(each TP rank holds a whole encoder), got {etp} (null = the foundation's parallel.tp={tp})"]  # fmt: skip
    if model_cfg.image_encoder.deepstack_visual_indexes:  # the layout returns the last layer's tokens only
        return [f"parallel.encoder_layout={layout} does not carry DeepStack features yet "
                "(model.image_encoder.deepstack_visual_indexes is set); use parallel.encoder_layout=shared"]  # fmt: skip
    return []


def encoder_on_every_stage(layout: str) -> bool:
    """Whether the layout builds the encoder on every pipeline stage (``build_model``'s flag)."""
    return layout == EncoderLayout.decoupled


def apply_encoder_layout(model: torch.nn.Module, layout: str, model_cfg, tp_group) -> torch.nn.Module:
    """Set the layout on a built VLM stage (before DDP wrapping); text models and stages without
    the encoder are returned as they are. ``decoupled`` also gives the model a ``forward_backward_wrapper`` for megatron's schedule (see
    :func:`loong_parallel.step.schedule_for`) and a ``finish_build`` (collective, called by
    :func:`loong_parallel.build_model_chunks` once every rank has built its stage)."""
    if layout == EncoderLayout.shared or getattr(model, "image_encoder", None) is None:
        return model
    if layout == EncoderLayout.decoupled:
        from loong_parallel.encoder_decoupled import DecoupledEncode

        decoupled = DecoupledEncode(model, vision_cost(model_cfg), dist.get_world_size(tp_group))
        model.vision_encode, model.forward_backward_wrapper, model.finish_build = decoupled, decoupled.wrap, decoupled.setup
        return model
    model.vision_encode = HeteroDPEncode(tp_group, vision_cost(model_cfg))
    return model
