"""Multimodal step data (``data.kind=multimodal``): conversations with images / videos.

Each step takes the next ``global_batch_size`` samples of one seeded sample stream (the same on
every rank); DP rank ``r`` keeps the ``r``-th slice, packs it into ``seq_length``-token THD
micro-batches and preprocesses only its own images. So a DP=N run sees the global batches of the
single-process run, and resuming at step ``s`` skips exactly ``s * global_batch_size`` samples
(tokenised and their images decoded, not resized/patchified): the streaming position resumes
exactly. The price: every rank reads (and decodes) every sample; shard-level DP splitting
(``PackedMultimodalDataset(dp_rank=...)``) would avoid it but does not keep the global batches of
a different DP size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loong_data.log import logger
from loong_data.multimodal.chat import ChatTokenizer, load_chat_tokenizer
from loong_data.multimodal.pipeline import (
    MultimodalSample,
    PackedMultimodalDataset,
    collate_multimodal,
    list_shards,
)
from loong_data.multimodal.processor import VisionProcessorConfig
from loong_data.packed_collate import padded_length
from loong_data.packing import packing_strategy
from loong_data.prefetch import pinned, prefetch, prefetch_process
from loong_data.step_data.config import DataConfig
from loong_data.step_data.layout import DataError, StepCounts, StepLayout, batch_digest
from loong_data.step_data.shards import convert_sources


def prefetch_mode(setting: str, *, cuda: bool, balanced: bool) -> str:
    """``data.multimodal.prefetch`` resolved: ``auto`` is the child process for a CUDA run without
    a balancer (its training loop is host-bound and shares no GIL with the packing), else the
    thread (a CPU run's few cores train; a balancer plans each step in the training process)."""
    if setting != "auto":
        return setting
    return "process" if cuda and not balanced else "thread"


@dataclass(frozen=True)
class PatchGeometry:
    """How the model cuts images into patches (its image encoder's sizes)."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int


@dataclass
class MultimodalStepData:
    tokenizer: ChatTokenizer
    processor: VisionProcessorConfig
    train_shards: list[Path]
    val_shards: list[Path]
    seq_length: int
    layout: StepLayout
    shuffle_buffer: int
    strategy: str
    prefetch: str = "auto"  # data.multimodal.prefetch
    _eval: list[dict] | None = field(default=None, repr=False)

    def _dataset(self, shards: list[Path], shuffle_buffer: int) -> PackedMultimodalDataset:
        return PackedMultimodalDataset(shards, self.tokenizer, seq_length=self.seq_length, processor=self.processor,
                                       seed=self.layout.seed, shuffle_buffer=max(1, shuffle_buffer))  # fmt: skip

    def _pack(self, samples: list[MultimodalSample]) -> list[dict]:
        """Packs of the samples, each padded to the layout's ``segment_multiple`` (context
        parallelism cuts every sample into 2 x cp chunks) before packing."""
        lengths = [padded_length(len(s), self.layout.segment_multiple) for s in samples]
        packs = packing_strategy(self.strategy).pack(lengths, self.seq_length)
        return [self._collate([samples[i] for i in pack], sum(lengths[i] for i in pack)) for pack in packs]

    def _collate(self, pack: list[MultimodalSample], tokens: int) -> dict:
        """One micro-batch of ``tokens`` (padded samples), its padding tail as short as the layout
        allows: padding tokens cost the LLM's GEMMs as much as real ones."""
        segment = self.layout.segment_multiple
        multiple = None if self.layout.pack_multiple is None else math.lcm(self.layout.pack_multiple, segment)
        capacity = self.seq_length if multiple is None else min(self.seq_length, padded_length(tokens, multiple))
        return collate_multimodal(pack, self.processor, capacity=capacity, pad_id=self.tokenizer.pad_id,
                                  segment_multiple=segment)  # fmt: skip

    def train_steps(self, start_step: int = 0, balancer: Any = None) -> Iterator[list[dict]]:
        """For each step from ``start_step``: this DP rank's packed micro-batches: its slice of the
        global batch, or the balancer's choice (``balancer.select(samples)``, the same plan on
        every rank; loong_parallel's SelectBalancer). Prepared one step ahead in a background
        thread (``prefetch="process"``, and ``"auto"`` on a CUDA device without a balancer: a child
        process), unless a refitting balancer plans the steps (its cost changes between steps), in
        page-locked memory for a CUDA device."""
        cuda = self.layout.device is not None and torch.device(self.layout.device).type == "cuda"
        if prefetch_mode(self.prefetch, cuda=cuda, balanced=balancer is not None) == "process":
            if balancer is not None:
                raise DataError("data.multimodal.prefetch=process plans the steps in a child process: it cannot "
                                "take parallel.balance's plans; use data.multimodal.prefetch=thread")  # fmt: skip
            return prefetch_process(partial(self._steps, start_step, None), pin=cuda)
        steps = pinned(self._steps(start_step, balancer), self.layout.device)
        return steps if getattr(balancer, "refit", None) is not None else prefetch(steps)

    def _steps(self, start_step: int, balancer: Any) -> Iterator[list[dict]]:
        lay = self.layout
        ds = self._dataset(self.train_shards, self.shuffle_buffer)
        stream = _forever(ds)
        skip = start_step * lay.global_batch_size
        if skip:
            logger.info("resuming the multimodal stream: skipping %d samples", skip)
            for _ in islice(stream, skip):
                pass
        per_rank = lay.global_batch_size // lay.dp_size
        while True:
            step = list(islice(stream, lay.global_batch_size))
            mine = balancer.select(step) if balancer else step[lay.dp_rank * per_rank : (lay.dp_rank + 1) * per_rank]
            yield self._pack(mine)

    def eval_microbatches(self) -> list[dict]:
        """This rank's share of the first held-out samples (the same every time)."""
        if self._eval is None:
            lay = self.layout
            num_samples = lay.eval_iters * lay.micro_batch_size * lay.dp_size
            ds = self._dataset(self.val_shards, 1)
            samples = list(islice(_forever(ds), num_samples))
            per_rank = num_samples // lay.dp_size
            self._eval = self._pack(samples[lay.dp_rank * per_rank : (lay.dp_rank + 1) * per_rank])
        return self._eval

    def counts(self, microbatches: list[dict], loss_tokens: int) -> StepCounts:
        """Real tokens (padding excluded, image tokens included; the loss counts only assistant
        tokens), their attention pairs, images + videos with their patch grids, and samples of the
        step, summed over the DP group (collectives), and the digest of what the step trained on
        (:func:`batch_digest`)."""
        tokens = pairs = samples = 0
        grids: list[tuple[int, int, int]] = []
        for mb in microbatches:
            cu, ids = mb["cu_seqlens"], mb["tokens"][0]
            tail = slice(int(cu[-2]), int(cu[-1]))
            padded = len(cu) > 2 and bool((ids[tail] == self.tokenizer.pad_id).all()) and not bool(
                mb["loss_mask"][0, tail].any()
            )
            lengths = torch.diff(cu).tolist()[: len(cu) - 1 - int(padded)]
            tokens, pairs, samples = tokens + sum(lengths), pairs + sum(n * n for n in lengths), samples + len(lengths)
            for key in ("image_grid_thw", "video_grid_thw"):
                if key in mb:
                    grids += [tuple(g) for g in mb[key].tolist()]
        t = torch.tensor([tokens, pairs, samples, batch_digest(microbatches)], dtype=torch.float64,
                         device=self.layout.device)  # fmt: skip
        dist.all_reduce(t, group=self.layout.dp_group)  # float64 holds sums of up to 2**21 CRCs exactly
        tokens, pairs, samples, digest = (int(x) for x in t.tolist())
        everyone: list = [None] * dist.get_world_size(self.layout.dp_group)
        dist.all_gather_object(everyone, grids, group=self.layout.dp_group)
        grids = [g for rank in everyone for g in rank]
        patches = sum(t * h * w for t, h, w in grids)
        return StepCounts(tokens=tokens, images=len(grids), patches=patches, samples=samples,
                          digest=digest % 2**32, token_pairs=pairs, grids=tuple(grids))  # fmt: skip


def _forever(ds: PackedMultimodalDataset) -> Iterator[MultimodalSample]:
    epoch = 0
    while True:
        any_sample = False
        for sample in ds.samples(epoch):
            any_sample = True
            yield sample
        if not any_sample:
            raise DataError(f"no usable sample in the shards {', '.join(map(str, ds.shards))}")
        epoch += 1


def _shard_folder(cfg: DataConfig, seed: int, is_main: bool) -> Path:
    """``data.multimodal.shards``, or the JSONL sources converted on the main rank first."""
    if cfg.multimodal.shards:
        return Path(cfg.multimodal.shards)
    folder = convert_sources(cfg.multimodal, cfg.cache_dir, seed) if is_main else None
    if dist.is_initialized():
        box = [str(folder) if folder else None]
        dist.broadcast_object_list(box, src=0)
        folder = Path(box[0])
    return folder


def load_multimodal_data(cfg: DataConfig, layout: StepLayout, patches: PatchGeometry, *, is_main: bool
                         ) -> MultimodalStepData:  # fmt: skip
    """Tokenizer, processor and train / held-out shards (converting on the main rank first)."""
    try:
        tokenizer = load_chat_tokenizer(cfg.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        raise DataError(f"data.tokenizer={cfg.tokenizer!r}: {e}") from None
    mm = cfg.multimodal
    folder = _shard_folder(cfg, layout.seed, is_main)
    try:
        shards = list_shards(folder)
    except FileNotFoundError as e:
        raise DataError(f"data.multimodal.shards: {e}") from None
    if len(shards) <= mm.val_shards:
        raise DataError(f"data.multimodal.val_shards={mm.val_shards} leaves no training shard of the "
                        f"{len(shards)} in {folder} (lower data.multimodal.samples_per_shard)")  # fmt: skip
    processor = VisionProcessorConfig(
        patch_size=patches.patch_size, temporal_patch_size=patches.temporal_patch_size,
        merge_size=patches.merge_size, min_pixels=mm.min_pixels, max_pixels=mm.max_pixels,
        video_min_pixels=mm.video_min_pixels, video_max_pixels=mm.video_max_pixels,
    )  # fmt: skip
    return MultimodalStepData(tokenizer, processor, shards[: -mm.val_shards], shards[-mm.val_shards :],
                              cfg.seq_length, layout, mm.shuffle_buffer, cfg.thd.strategy, mm.prefetch)  # fmt: skip
