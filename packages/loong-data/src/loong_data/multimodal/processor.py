"""Images and videos to vision-encoder patches, in the layout of HF's Qwen2-VL image processor.

An image is resized so that both sides are multiples of ``patch_size * merge_size`` and its area
lies within ``[min_pixels, max_pixels]`` ("smart resize", aspect ratio kept), rescaled to [0, 1],
normalised with the CLIP mean/std and cut into ``patch_size`` squares. Patches are ordered by
``merge_size x merge_size`` window (the order in which the projector merges them), each patch
flattened as ``(channel, temporal, row, column)``. An image is one frame repeated
``temporal_patch_size`` times; a video's frames are grouped ``temporal_patch_size`` at a time
(the last frame repeated to fill the last group).
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

# OpenAI CLIP normalisation, which Qwen2-VL / Qwen2.5-VL use.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class VisionProcessorConfig:
    """Parameters of the image/video preprocessing; defaults are Qwen2.5-VL's.

    ``min_pixels`` / ``max_pixels`` bound the area of a resized image; ``video_min_pixels`` /
    ``video_max_pixels`` the area of each resized video frame.
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    def __post_init__(self) -> None:
        for name in (
            "patch_size",
            "temporal_patch_size",
            "merge_size",
            "min_pixels",
            "max_pixels",
            "video_min_pixels",
            "video_max_pixels",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(
                    f"VisionProcessorConfig.{name} must be a positive integer, got {getattr(self, name)}"
                )
        if self.min_pixels > self.max_pixels or self.video_min_pixels > self.video_max_pixels:
            raise ValueError(f"VisionProcessorConfig: min pixels above max pixels in {self}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("VisionProcessorConfig.image_mean / image_std must have 3 values (RGB)")

    @classmethod
    def from_hf(cls, config: Mapping, video_config: Mapping | None = None) -> "VisionProcessorConfig":
        """From the dict of an HF Qwen2-VL / Qwen2.5-VL image processor (``preprocessor_config.json``
        or ``processor.to_dict()``) and optionally of its video processor; missing keys keep our defaults."""
        kwargs: dict = {
            k: int(config[k]) for k in ("patch_size", "temporal_patch_size", "merge_size") if k in config
        }
        for prefix, source in (("", config), ("video_", video_config or {})):
            size = source.get("size") or {}
            low = source.get("min_pixels", size.get("shortest_edge"))
            high = source.get("max_pixels", size.get("longest_edge"))
            if low is not None:
                kwargs[f"{prefix}min_pixels"] = int(low)
            if high is not None:
                kwargs[f"{prefix}max_pixels"] = int(high)
        for key in ("image_mean", "image_std"):
            if config.get(key) is not None:
                kwargs[key] = tuple(float(x) for x in config[key])
        return cls(**kwargs)

    @property
    def factor(self) -> int:
        """Sides of a resized image are multiples of this."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: ``3 * temporal_patch_size * patch_size**2``."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def num_tokens(self, grid_thw: Sequence[int]) -> int:
        """LLM tokens of one image/video of this grid: ``t * h * w / merge_size**2``."""
        t, h, w = (int(x) for x in grid_thw)
        return t * h * w // self.merge_size**2

    def image_grid(self, height: int, width: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patch grid of an image of this size (no pixels needed)."""
        rh, rw = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return 1, rh // self.patch_size, rw // self.patch_size

    def video_grid(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """``(t, h, w)`` patch grid of a video of ``num_frames`` frames of this size."""
        rh, rw = smart_resize(height, width, self.factor, self.video_min_pixels, self.video_max_pixels)
        return math.ceil(num_frames / self.temporal_patch_size), rh // self.patch_size, rw // self.patch_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size Qwen2-VL resizes an image to: sides multiples of ``factor``, nearest to the
    original, area within ``[min_pixels, max_pixels]``, aspect ratio kept as closely as possible."""
    if min(height, width) < 1:
        raise ValueError(f"image of size {height}x{width} is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image of size {height}x{width}: aspect ratio above {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _normalised(image: Image.Image, height: int, width: int, config: VisionProcessorConfig) -> np.ndarray:
    """``[3, height, width]`` float32: resized (bicubic, as HF), scaled to [0, 1], normalised."""
    image = image.convert("RGB")
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    pixels = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) * np.float32(1 / 255)
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
    return (pixels - mean) / std


def _patchify(frames: np.ndarray, config: VisionProcessorConfig) -> np.ndarray:
    """``[T, 3, H, W]`` (T a multiple of temporal_patch_size) -> ``[T/tp * H/p * W/p, patch_dim]``."""
    p, m, tp = config.patch_size, config.merge_size, config.temporal_patch_size
    t, c, h, w = frames.shape
    gt, gh, gw = t // tp, h // p, w // p
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    # -> (gt, gh/m, gw/m, m, m, c, tp, p, p): merge windows outermost, then the patch content.
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * tp * p * p)


def process_image(image: Image.Image, config: VisionProcessorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values [h*w, patch_dim]`` float32 and ``grid_thw [3]`` int64 of one image."""
    _, gh, gw = config.image_grid(image.height, image.width)
    frame = _normalised(image, gh * config.patch_size, gw * config.patch_size, config)
    frames = np.broadcast_to(frame, (config.temporal_patch_size, *frame.shape))
    return torch.from_numpy(_patchify(frames, config)), torch.tensor([1, gh, gw], dtype=torch.int64)


def process_video(
    frames: Sequence[Image.Image], config: VisionProcessorConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values [t*h*w, patch_dim]`` and ``grid_thw [3]`` of a video given as its frames
    (all resized to the grid of the first frame's size)."""
    if not frames:
        raise ValueError("a video needs at least one frame")
    gt, gh, gw = config.video_grid(len(frames), frames[0].height, frames[0].width)
    h, w = gh * config.patch_size, gw * config.patch_size
    stacked = [_normalised(frame, h, w, config) for frame in frames]
    stacked += [stacked[-1]] * (gt * config.temporal_patch_size - len(stacked))  # pad with the last frame
    return torch.from_numpy(_patchify(np.stack(stacked), config)), torch.tensor(
        [gt, gh, gw], dtype=torch.int64
    )


def process_images(
    images: Sequence[Image.Image], config: VisionProcessorConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Several images: ``pixel_values`` concatenated in order and ``image_grid_thw [N, 3]``."""
    if not images:
        return torch.zeros(0, config.patch_dim), torch.zeros(0, 3, dtype=torch.int64)
    pixels, grids = zip(*(process_image(image, config) for image in images))
    return torch.cat(pixels), torch.stack(grids)
