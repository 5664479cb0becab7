"""The tokenizer (loong-data), the model (loong-models) and the converter (loong-ckpt) share one
vision-token-id type, so the tokenizer's ids and the model's compare as values."""

import pytest

from loong_data.multimodal import load_chat_tokenizer
from loong_models import VisionTokenIds, load_model_config
from loong_xpu.tokens import VisionTokenIds as SharedVisionTokenIds


def test_the_chat_tokenizers_vision_ids_are_the_models_type_and_values():
    chat = load_chat_tokenizer(None)  # the bundled chat tokenizer, whose ids the zoo's tiny VLM uses
    model = load_model_config("tiny-vlm")
    assert VisionTokenIds is SharedVisionTokenIds and type(chat.vision) is VisionTokenIds
    assert model.vision_token_ids == chat.vision
    model.check_tokenizer(chat.vocab_size, chat.vision, source="bundled")


def test_a_model_whose_image_token_is_not_the_tokenizers_is_refused_naming_the_key():
    chat = load_chat_tokenizer(None)
    model = load_model_config("tiny-vlm", [f"image_token_id={chat.vision.video_token_id}"])
    assert model.vision_token_ids != chat.vision
    with pytest.raises(ValueError, match=f"set model.image_token_id={chat.vision.image_token_id}$"):
        model.check_tokenizer(chat.vocab_size, chat.vision, source="bundled")

