"""``parallel.encoder_layout=decoupled``: a VLM's image encoder runs outside the pipeline schedule,
on every rank of the model-parallel group (TP x PP ranks of one data-parallel replica).

Every rank of the group reads the same micro-batches, so each can plan the whole step alone. The
schedule of megatron (``forward_backward_func``) is wrapped in three phases:

1. **Encode.** The images and video clips of all micro-batches of the step are pooled and split
   over the group's ranks by their ViT cost (LPT, the same plan everywhere). Each rank encodes and
   projects its share in one packed pass; point-to-point sends bring the rows to the first
   pipeline stage's TP ranks, where every (micro-batch, media kind) gets a leaf tensor.
2. **Schedule.** megatron's own schedule runs; the first stage's ``vision_encode`` hands it the
   leaf of each micro-batch in turn, so the LLM's backward leaves the embeddings' gradient in the
   leaves (TP-replicated: the first layer's input gradient is all-reduced, or all-gathered with
   sequence parallelism).
3. **Encoder backward.** Before megatron finalises the gradients, each first-stage rank sends the
   rows' gradient to the ranks of its own pipeline group, each rank runs the encoder backward of
   its share, and the encoder's gradients are summed over the pipeline group. They are scaled by
   TP first: ``finalize_model_grads`` averages the replicated encoder over TP, so the result is the
   sum over all TP x PP ranks, a single process's gradient.

The copies of the encoder on later stages start from the first stage's weights (broadcast when
built) and get the same summed gradients, so every copy takes the same optimizer step; the grad
norm counts the first stage's copy only (``param.shared`` on the others, set by ``build_model``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.utils import get_model_config
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from loong_parallel.balance import split_media

# (pixels key, grid key) of each media kind, in the order OmniCombinationModel merges them
MEDIA = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


@dataclass(frozen=True)
class Item:
    """One image or video clip of the step: its micro-batch, media kind and patch rows."""

    microbatch: int
    kind: int  # index into MEDIA
    grid: tuple[int, int, int]
    rows: slice  # its patches in the micro-batch's pixel tensor


@dataclass
class StepPlan:
    """What phase 1 leaves for phases 2 and 3."""

    counts: list[int]  # vision tokens each rank of the group encoded
    local: torch.Tensor | None = None  # this rank's encoded rows (with their graph when training)
    leaves: deque = field(default_factory=deque)  # first stage: (grid_thw, leaf) in the order the model asks
    used: list[torch.Tensor] = field(default_factory=list)  # first stage: the leaves, in row order
    order: torch.Tensor | None = None  # first stage: rank-order row of each item-order row


def media_items(batches: list[dict]) -> list[Item]:
    """Every image / clip of the micro-batches, in the order the model consumes them."""
    items = []
    for m, batch in enumerate(batches):
        for kind, (pixels_key, grid_key) in enumerate(MEDIA):
            if pixels_key not in batch or not batch[pixels_key].numel():
                continue
            start = 0
            for t, h, w in batch[grid_key].tolist():
                items.append(Item(m, kind, (t, h, w), slice(start, start + t * h * w)))
                start += t * h * w
    return items


class DecoupledEncode:
    """The layout on one rank: ``vision_encode`` hook of the model (first stage) and wrapper of
    megatron's ``forward_backward_func`` (every stage). ``model``: this rank's unwrapped VLM stage."""

    def __init__(self, model: torch.nn.Module, cost: Callable, tp: int) -> None:
        self.model, self.cost, self.scale = model, cost, float(tp)
        self.plan: StepPlan | None = None

    def setup(self) -> None:
        """Collective over the model-parallel group, once every rank has built its stage (ranks
        build the stages before their own too, see loong_parallel.model): the group's layout, and
        the first stage's encoder weights on every stage (each stage draws its own)."""
        self.group = mpu.get_model_parallel_group()
        self.pp_group = mpu.get_pipeline_model_parallel_group()
        self.size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.ranks = dist.get_process_group_ranks(self.group)  # global rank of each group rank
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)  # first: this TP rank's first stage
        self.me = dist.get_rank()
        stages = [None] * self.size
        dist.all_gather_object(stages, mpu.get_pipeline_model_parallel_rank(), group=self.group)
        self.first_stage = [g for g, s in zip(self.ranks, stages) if s == 0]
        self.is_first = self.me in self.first_stage
        self._broadcast_weights()

    def vision_params(self) -> list[torch.nn.Parameter]:
        return [p for m in (self.model.image_encoder, self.model.image_projector) for p in m.parameters()]

    @torch.no_grad()
    def _broadcast_weights(self) -> None:
        """Every stage's copy starts from the first stage's weights."""
        params = self.vision_params()
        flat = _flatten_dense_tensors([p.data for p in params])
        dist.broadcast(flat, self.pp_ranks[0], group=self.pp_group)
        for p, value in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
            p.data.copy_(value)

    # --- phase 2: the model asks for each micro-batch's embeddings --------------------------------
    def __call__(self, model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        if self.plan is None or not self.plan.leaves:
            raise RuntimeError("parallel.encoder_layout=decoupled: the model ran outside its schedule wrapper "
                               "(the step's media are encoded before megatron's schedule)")  # fmt: skip
        grid, leaf = self.plan.leaves.popleft()
        if grid.tolist() != grid_thw.tolist():
            raise RuntimeError(f"parallel.encoder_layout=decoupled: the schedule asked for media {grid_thw.tolist()} "
                               f"but the next encoded ones are {grid.tolist()}")  # fmt: skip
        return leaf

    # --- the wrapper of megatron's schedule --------------------------------------------------------
    def wrap(self, func: Callable) -> Callable:
        """``func`` with phase 1 before it and phase 3 just before its gradient finalisation."""

        def run(*, data_iterator, model, num_microbatches: int, forward_only: bool = False, **kwargs):
            batches = [next(data_iterator) for _ in range(num_microbatches)]
            train = not forward_only and any(p.requires_grad for p in self.vision_params())
            self.plan = self.encode(batches, train)
            config = get_model_config(model[0] if isinstance(model, list) else model)
            finalize = config.finalize_model_grads_func
            if train:
                if finalize is None:
                    raise RuntimeError("parallel.encoder_layout=decoupled needs config.finalize_model_grads_func "
                                       "(the encoder backward runs just before it)")  # fmt: skip

                def finalize_after_encoder(*args, **kw):
                    self.backward()
                    return finalize(*args, **kw)

                config.finalize_model_grads_func = finalize_after_encoder
            try:
                return func(data_iterator=iter(batches), model=model, num_microbatches=num_microbatches,
                            forward_only=forward_only, **kwargs)  # fmt: skip
            finally:
                config.finalize_model_grads_func = finalize
                self.plan = None

        return run

    # --- phase 1 ------------------------------------------------------------------------------------
    def encode(self, batches: list[dict], train: bool) -> StepPlan:
        items = media_items(batches)
        owner = split_media([it.grid for it in items], self.size, self.cost)
        unit = self.model.spatial_merge_size**2
        tokens = [int(np.prod(it.grid)) // unit for it in items]
        counts = [sum(n for n, o in zip(tokens, owner) if o == r) for r in range(self.size)]
        mine = [it for it, o in zip(items, owner) if o == self.rank]
        plan = StepPlan(counts)
        if mine:
            with torch.set_grad_enabled(train):
                plan.local = self._encode(batches, mine)
        gathered = self._to_first_stage(plan.local, counts)
        if gathered is not None:
            self._make_leaves(plan, items, owner, tokens, gathered, train)
        return plan

    def _encode(self, batches: list[dict], items: list[Item]) -> torch.Tensor:
        device = next(self.model.image_projector.parameters()).device
        pixels = torch.cat([batches[it.microbatch][MEDIA[it.kind][0]][it.rows] for it in items]).to(device)
        grids = torch.tensor([it.grid for it in items], dtype=torch.long)  # host bookkeeping: no device read
        return self.model.image_projector(self.model.image_encoder(pixels, grids))

    def _empty(self, rows: int) -> torch.Tensor:
        like = next(self.model.image_projector.parameters())
        return torch.empty(rows, self.model.config.hidden_size, dtype=like.dtype, device=like.device)

    def _to_first_stage(self, local: torch.Tensor | None, counts: list[int]) -> torch.Tensor | None:
        """Every rank's rows to every first-stage rank (rank order); None on the other stages."""
        ops, parts = [], []
        if local is not None:
            sent = local.detach().contiguous()
            ops += [dist.isend(sent, dst, group=None) for dst in self.first_stage if dst != self.me]
        if self.is_first:
            for r, n in enumerate(counts):
                if self.ranks[r] == self.me:
                    parts.append(local.detach() if local is not None else self._empty(0))
                    continue
                parts.append(self._empty(n))
                if n:
                    ops.append(dist.irecv(parts[-1], self.ranks[r]))
        for op in ops:
            op.wait()
        return torch.cat(parts) if self.is_first else None

    def _make_leaves(
        self, plan: StepPlan, items: list[Item], owner, tokens: list[int], gathered, train
    ) -> None:
        """Item-order rows of the rank-order gather, one leaf per (micro-batch, kind)."""
        offsets = np.concatenate([[0], np.cumsum(plan.counts)])[:-1]
        order = []
        for n, o in zip(tokens, owner):
            order.append(torch.arange(int(offsets[o]), int(offsets[o]) + n))
            offsets[o] += n
        plan.order = torch.cat(order).to(gathered.device)
        rows = gathered[plan.order]
        start = 0
        for key in dict.fromkeys((it.microbatch, it.kind) for it in items):
            group = [i for i, it in enumerate(items) if (it.microbatch, it.kind) == key]
            n = sum(tokens[i] for i in group)
            leaf = rows[start : start + n].detach().requires_grad_(train)
            start += n
            plan.used.append(leaf)
            plan.leaves.append((torch.tensor([items[i].grid for i in group], dtype=torch.long), leaf))

    # --- phase 3 ------------------------------------------------------------------------------------
    def backward(self) -> None:
        """The embeddings' gradient back to the encoding ranks, their encoder backward, and the
        encoder's gradients summed over the pipeline group."""
        plan = self.plan
        assert plan is not None
        grad = self._grad_from_first_stage(plan)
        if plan.local is not None and plan.local.requires_grad:
            torch.autograd.backward(plan.local, grad * self.scale)
        params = [p for p in self.vision_params() if p.requires_grad]
        grads = [(p.main_grad if hasattr(p, "main_grad") else p.grad) for p in params]
        grads = [g if g is not None else torch.zeros_like(p) for p, g in zip(params, grads)]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.pp_group)
        for p, g, summed in zip(params, grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(summed)
            if not hasattr(p, "main_grad"):
                p.grad = g

    def _grad_from_first_stage(self, plan: StepPlan) -> torch.Tensor:
        """This rank's rows of the embeddings' gradient, from the first stage of its pipeline group
        (every first-stage TP rank holds the whole, identical gradient and serves its own group)."""
        mine = self._empty(plan.counts[self.rank])
        if self.is_first:
            leaf_grads = [
                leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in plan.used
            ]
            by_rank = self._empty(sum(plan.counts))
            if leaf_grads:
                by_rank[plan.order] = torch.cat(leaf_grads).to(by_rank.dtype)
            offsets = np.concatenate([[0], np.cumsum(plan.counts)])
            ops = []
            for dst in self.pp_ranks:
                r = self.ranks.index(dst)
                part = by_rank[int(offsets[r]) : int(offsets[r + 1])]
                if dst == self.me:
                    mine = part
                elif part.shape[0]:
                    ops.append(dist.isend(part.contiguous(), dst))
            for op in ops:
                op.wait()
        elif mine.shape[0]:
            dist.irecv(mine, self.pp_ranks[0]).wait()
        return mine
