"""Multimodal (vision-language) data: chat tokenizer, image/video patches, WebDataset shards, packing.

from loong_data.multimodal import (PackedMultimodalDataset, VisionProcessorConfig,
                                   convert_to_webdataset, default_multimodal_dataset)
convert_to_webdataset([default_multimodal_dataset() / "conversations.jsonl"], "outputs/vlm-shards")
data = PackedMultimodalDataset("outputs/vlm-shards", seq_length=1024, dp_rank=0, dp_size=1, seed=0)
batch = next(iter(data))   # tokens, labels, loss_mask, position_ids, cu_seqlens, max_seqlen,
                           # pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
"""

from loong_data.bundled import default_chat_tokenizer, default_multimodal_dataset
from loong_data.multimodal.chat import (
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    ChatTokenizer,
    ConversationError,
    load_chat_tokenizer,
)
from loong_data.multimodal.convert import (
    ConvertError,
    ConvertReport,
    bundled_multimodal_shards,
    convert_to_webdataset,
    write_webdataset,
)
from loong_data.multimodal.pipeline import (
    MultimodalDataError,
    MultimodalSample,
    PackedMultimodalDataset,
    collate_multimodal,
    encode_sample,
    list_shards,
)
from loong_data.multimodal.processor import (
    CLIP_MEAN,
    CLIP_STD,
    VisionProcessorConfig,
    process_image,
    process_images,
    process_video,
    smart_resize,
)

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "IMAGE_PAD",
    "VIDEO_PAD",
    "VISION_END",
    "VISION_START",
    "ChatTokenizer",
    "ConversationError",
    "ConvertError",
    "ConvertReport",
    "MultimodalDataError",
    "MultimodalSample",
    "PackedMultimodalDataset",
    "VisionProcessorConfig",
    "bundled_multimodal_shards",
    "collate_multimodal",
    "convert_to_webdataset",
    "write_webdataset",
    "default_chat_tokenizer",
    "default_multimodal_dataset",
    "encode_sample",
    "list_shards",
    "load_chat_tokenizer",
    "process_image",
    "process_images",
    "process_video",
    "smart_resize",
]
