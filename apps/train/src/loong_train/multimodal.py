"""The multimodal data path of the train app (``data.kind=multimodal``): WebDataset shards (made
once from JSONL + media into the data cache), streamed per DP rank, packed into THD micro-batches
with images (the micro-batch contract of loong-data), plus the checks that model, tokenizer and
data agree."""

from __future__ import annotations

MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
