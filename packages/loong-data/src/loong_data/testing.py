"""Helpers for Loong's tests of multimodal models: the bundled multimodal samples at small image
sizes, grouped by the media they hold, so that a test can pick micro-batches with 0, 1 or 5 images
and a video. Not used by the package."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from loong_data.multimodal import (
    MultimodalSample,
    PackedMultimodalDataset,
    VisionProcessorConfig,
    bundled_multimodal_shards,
)


def small_vision_processor(patch_size: int, temporal_patch: int, merge_size: int) -> VisionProcessorConfig:
    """A model's patch geometry with images of at most 112 x 112 pixels and video frames of 56 x 56:
    a few dozen vision tokens per image, for CPU tests."""
    return VisionProcessorConfig(patch_size=patch_size, temporal_patch_size=temporal_patch,
                                 merge_size=merge_size, max_pixels=112 * 112,
                                 video_min_pixels=56 * 56, video_max_pixels=56 * 56)  # fmt: skip


def media_counts(sample: MultimodalSample) -> tuple[int, int]:
    """(images, videos) of a sample."""
    return sum(k == "image" for k, _ in sample.media), sum(k == "video" for k, _ in sample.media)


def bundled_samples_by_media(
    folder: Path, processor: VisionProcessorConfig, seq_length: int
) -> tuple[PackedMultimodalDataset, dict[tuple[int, int], list[MultimodalSample]]]:
    """The dataset of the bundled samples (converted into ``folder``; under torch.distributed rank 0
    converts, the others wait) and its samples, in order, by :func:`media_counts`."""
    if dist.is_initialized():
        if dist.get_rank() == 0:
            bundled_multimodal_shards(folder)
        dist.barrier()
    shards = bundled_multimodal_shards(folder)
    ds = PackedMultimodalDataset(shards, seq_length=seq_length, processor=processor, seed=0, shuffle_buffer=1)
    by_media: dict[tuple[int, int], list[MultimodalSample]] = {}
    for s in ds.samples(0):
        by_media.setdefault(media_counts(s), []).append(s)
    return ds, by_media
