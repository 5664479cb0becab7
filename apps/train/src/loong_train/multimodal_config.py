"""Config of the multimodal data path (``data.kind=multimodal``, keys ``data.multimodal.*``). Kept
apart from schema.py, like packing_config.py, so the text path stays as it was."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MultimodalDataConfig:
    # A folder of WebDataset .tar shards (`loong-data convert-to-webdataset` writes them) ...
    shards: str | None = None
    # ... or JSONL files (one conversation + media paths per line) converted into data.cache_dir on
    # first use; media paths are relative to media_root (default: each JSONL file's folder).
    # Neither: the bundled real images with captions and questions.
    jsonl: list[str] = field(default_factory=list)
    media_root: str | None = None
    samples_per_shard: int = 64  # when converting JSONL
    val_shards: int = 1  # the last shards (in name order) are held out for evaluation
    # Image processor: every image is resized so that its pixel count lies in [min_pixels,
    # max_pixels] with sides divisible by patch_size * merge_size (those two come from the model).
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448
    video_min_pixels: int = 56 * 56  # the same bounds for each video frame
    video_max_pixels: int = 448 * 448
    shuffle_buffer: int = 64  # samples shuffled together while streaming (0: stream order)


def validate_multimodal(kind: str, mm: MultimodalDataConfig, *, packing: str) -> list[str]:
    """Problems with the multimodal data keys, each naming the key (empty when fine)."""
    errors = []
    if kind != "multimodal":
        return errors
    if mm.shards and mm.jsonl:
        errors.append(
            "data.multimodal.shards and data.multimodal.jsonl are exclusive: give shards or JSONL files"
        )
    if packing != "thd":
        errors.append(
            f"data.packing={packing!r}: multimodal data is packed with cu_seqlens; set data.packing=thd"
        )
    if mm.samples_per_shard < 1:
        errors.append(f"data.multimodal.samples_per_shard={mm.samples_per_shard} must be >= 1")
    if mm.val_shards < 1:
        errors.append(
            f"data.multimodal.val_shards={mm.val_shards} must be >= 1 (evaluation needs a held-out shard)"
        )
    if not 0 < mm.min_pixels <= mm.max_pixels:
        errors.append(
            f"data.multimodal.min_pixels={mm.min_pixels} and max_pixels={mm.max_pixels} need "
            "0 < min_pixels <= max_pixels"
        )
    if not 0 < mm.video_min_pixels <= mm.video_max_pixels:
        errors.append(
            f"data.multimodal.video_min_pixels={mm.video_min_pixels} and video_max_pixels="
            f"{mm.video_max_pixels} need 0 < video_min_pixels <= video_max_pixels"
        )
    if mm.shuffle_buffer < 0:
        errors.append(f"data.multimodal.shuffle_buffer={mm.shuffle_buffer} must be >= 0")
    return errors


def validate_encoder_layout(layout: str, model, tp: int) -> list[str]:
    """``parallel.encoder_layout=hetero_dp`` needs a VLM whose encoder is replicated (TP=1)
    inside a foundation TP group of more than one rank."""
    if layout != "hetero_dp":
        return []
    if model.image_encoder is None:
        return ["parallel.encoder_layout=hetero_dp needs a VLM (model.image_encoder is null)"]
    etp = model.image_encoder.tensor_model_parallel_size
    if etp != 1:
        return [f"parallel.encoder_layout=hetero_dp needs model.image_encoder.tensor_model_parallel_size=1 "
                f"(each TP rank holds a whole encoder), got {etp} (null = the foundation's parallel.tp={tp})"]  # fmt: skip
    return []
