"""A training run's data, one object per run whatever the data kind: ``build_step_data`` turns the
``data`` config into a :class:`StepData` that yields each step's micro-batches for this DP rank.

    data = build_step_data(cfg, StepLayout(micro_batch_size=4, global_batch_size=16,
                                           num_microbatches=4, eval_iters=2, seed=0), is_main=True)
    microbatches = next(data.train_steps())   # dicts: tokens, labels, loss_mask, position_ids (+ ...)

A new data kind is a :class:`DataKind` member with a loader in ``_LOADERS``; a trainer also takes
any object with the :class:`StepData` methods directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from loong_data.step_data.config import (
    DataConfig,
    DataKind,
    LeRobotDataConfig,
    MultimodalDataConfig,
    Packing,
    ThdConfig,
)
from loong_data.step_data.diffusion import DiffusionDataConfig, DiffusionStepData, load_diffusion_data
from loong_data.step_data.layout import DataError, StepCounts, StepLayout, batch_digest
from loong_data.step_data.multimodal import MultimodalStepData, PatchGeometry, load_multimodal_data
from loong_data.step_data.text import Balancer, PackedDocuments, TextStepData, load_text_data, step_batches


class StepData(Protocol):
    """What the trainer asks of a run's data."""

    tokenizer: Any  # .vocab_size, .path, .pad_id

    def train_steps(self, start_step: int = 0, balancer: Balancer | None = None) -> Iterator[list[dict]]:
        """Per step after ``start_step``: this DP rank's micro-batches (dicts of tensors);
        ``balancer`` moves samples between DP ranks (a collective each step)."""

    def eval_microbatches(self) -> list[dict]:
        """This DP rank's held-out micro-batches (the same every time)."""

    def counts(self, microbatches: list[dict], loss_tokens: int) -> StepCounts:
        """What a step consumed (may be a collective over the DP group)."""


def _text(cfg: DataConfig, layout: StepLayout, *, is_main: bool, patches: PatchGeometry | None) -> StepData:
    return load_text_data(cfg, layout, is_main=is_main)


def _multimodal(cfg: DataConfig, layout: StepLayout, *, is_main: bool, patches: PatchGeometry | None) -> StepData:
    if patches is None:
        raise DataError("data.kind=multimodal (images in the data) needs a model that cuts images into patches")
    return load_multimodal_data(cfg, layout, patches, is_main=is_main)


def _diffusion(cfg: DataConfig, layout: StepLayout, *, is_main: bool, patches: PatchGeometry | None) -> StepData:
    return load_diffusion_data(cfg, layout, is_main=is_main, patches=patches)


def _lerobot(cfg: DataConfig, layout: StepLayout, *, is_main: bool, patches: PatchGeometry | None) -> StepData:
    from loong_data.step_data.lerobot import load_lerobot_data  # pyarrow only when used

    return load_lerobot_data(cfg, layout)


# One loader per data kind: a new kind is a DataKind member and a loader here (or a StepData
# handed to the trainer directly).
_LOADERS: dict[DataKind, Callable[..., StepData]] = {DataKind.text: _text, DataKind.chat: _text,
                                                     DataKind.multimodal: _multimodal, DataKind.lerobot: _lerobot,
                                                     DataKind.diffusion: _diffusion}  # fmt: skip


def build_step_data(cfg: DataConfig, layout: StepLayout, *, is_main: bool = True,
                    patches: PatchGeometry | None = None) -> StepData:  # fmt: skip
    """The run's step data for ``cfg.kind``. Collective under torch.distributed (the main rank
    prepares caches first). ``patches``: the model's patch geometry (multimodal data)."""
    return _LOADERS[DataKind(cfg.kind)](cfg, layout, is_main=is_main, patches=patches)


__all__ = [
    "Balancer",
    "DataConfig",
    "DataError",
    "DataKind",
    "DiffusionDataConfig",
    "DiffusionStepData",
    "LeRobotDataConfig",
    "MultimodalDataConfig",
    "MultimodalStepData",
    "PackedDocuments",
    "Packing",
    "PatchGeometry",
    "StepCounts",
    "StepData",
    "StepLayout",
    "batch_digest",
    "TextStepData",
    "ThdConfig",
    "build_step_data",
    "step_batches",
]
