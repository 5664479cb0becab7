"""Token ids that packages which may not import each other agree on.

The tokenizer (loong-data) finds a VLM's vision special tokens, the model (loong-models) places
image features and multimodal RoPE positions by them and the converter (loong-ckpt) reads and
writes them in HF's config.json. loong-data and loong-models do not depend on each other; both
depend on loong-xpu, the bottom of Loong's layering (DESIGN.md), so their one type lives here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionTokenIds:
    """Ids of a VLM's vision special tokens (Qwen2.5-VL's layout: ``<|vision_start|>``, one
    ``<|image_pad|>`` / ``<|video_pad|>`` per merged patch, ``<|vision_end|>``). The fields are
    named as the ``model.*`` keys and HF's config.json keys that hold them; a model may leave all
    but ``image_token_id`` unset, a chat tokenizer sets all four."""

    image_token_id: int
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
