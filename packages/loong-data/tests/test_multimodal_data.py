"""The bundled multimodal sample, the chat tokenizer and the image processor (parity with HF)."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from loong_data import default_tokenizer, load_tokenizer
from loong_data.multimodal import (
    ChatTokenizer,
    VisionProcessorConfig,
    default_chat_tokenizer,
    default_multimodal_dataset,
    load_chat_tokenizer,
    process_image,
    process_video,
)
from loong_data.tools.build_chat_tokenizer import CHAT_SPECIAL_TOKENS, build_chat_tokenizer

SAMPLE = default_multimodal_dataset()


def _records() -> list[dict]:
    return [
        json.loads(line) for line in (SAMPLE / "conversations.jsonl").read_text(encoding="utf-8").splitlines()
    ]


def _media(record: dict) -> list[tuple[str, object]]:
    return [
        (item["type"], item[item["type"]])
        for m in record["messages"]
        if isinstance(m["content"], list)
        for item in m["content"]
        if item["type"] in ("image", "video")
    ]


def test_bundled_sample_references_existing_decodable_media() -> None:
    records = _records()
    assert len(records) == 336 and len({r["id"] for r in records}) == len(records)
    kinds = {"text": 0, "image": 0, "multi-image": 0, "video": 0, "mixed": 0}
    referenced = set()
    for record in records:
        media = _media(record)
        assert any(m["role"] == "assistant" for m in record["messages"]), record["id"]
        images = [ref for kind, ref in media if kind == "image"]
        videos = [ref for kind, ref in media if kind == "video"]
        kind = (
            "mixed"
            if images and videos
            else "video"
            if videos
            else {0: "text", 1: "image"}.get(len(images), "multi-image")
        )
        kinds[kind] += 1
        for ref in images:
            referenced.add(ref)
        for ref in videos:
            frames = sorted((SAMPLE / ref).glob("*.jpg"))
            assert len(frames) == 8, ref
            referenced.update(str(f.relative_to(SAMPLE)) for f in frames)
    assert kinds == {"text": 30, "image": 244, "multi-image": 50, "video": 6, "mixed": 6}
    for ref in sorted(referenced):
        with Image.open(SAMPLE / ref) as image:
            image.load()
    # Every shipped media file is used, and the sample stays small.
    shipped = {str(p.relative_to(SAMPLE)) for p in SAMPLE.rglob("*") if p.suffix in (".jpg", ".png")}
    assert shipped == referenced and len(shipped) == 17 + 200 + 48
    assert sum(p.stat().st_size for p in SAMPLE.rglob("*") if p.is_file()) < 2_000_000
    attribution = (SAMPLE / "ATTRIBUTION.md").read_text(encoding="utf-8")
    assert "CC BY 4.0" in attribution and "NOT recordings" in attribution


def test_bundled_captions_are_the_skimage_docstrings() -> None:
    skimage_data = pytest.importorskip("skimage.data")  # a dev-time tool only; usually absent
    by_id = {r["id"]: r for r in _records()}
    for name in ("astronaut", "coffee", "rocket"):
        caption = getattr(skimage_data, name).__doc__.strip().splitlines()[0]
        assert by_id[f"caption-{name}"]["messages"][-1]["content"][0]["text"] == caption


def test_chat_tokenizer_folder_is_reproduced_by_its_script(tmp_path: Path) -> None:
    build_chat_tokenizer(default_tokenizer(), tmp_path / "tok")
    committed = default_chat_tokenizer()
    names = sorted(p.name for p in committed.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "tok").iterdir())
    for name in names:
        assert (tmp_path / "tok" / name).read_bytes() == (committed / name).read_bytes(), name


def test_chat_tokenizer_loads_with_autotokenizer_and_renders_vision_items() -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_chat_tokenizer()))
    base = load_tokenizer(default_tokenizer())
    # The BPE is unchanged; the special tokens follow it.
    assert [hf.convert_tokens_to_ids(t) for t in CHAT_SPECIAL_TOKENS] == list(range(8192, 8198))
    text = "To be, or not to be: that is the question."
    assert hf.encode(text, add_special_tokens=False) == base.encode(text)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Yes."},
    ]
    rendered = hf.apply_chat_template(messages, tokenize=False)
    assert rendered == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|>"
        "<|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\nYes.<|im_end|>\n"
    )
    assert hf.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True).endswith(
        "<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return load_chat_tokenizer()


def _dialogue() -> list[dict]:
    return next(r for r in _records() if r["id"] == "digit-dialogue-00")["messages"]


def test_loss_mask_is_on_assistant_tokens_only(chat: ChatTokenizer) -> None:
    messages = _dialogue()
    sample = chat.sample(messages, media_tokens=[4])
    tokens, labels, mask = sample["tokens"], sample["labels"], sample["loss_mask"]
    assert torch.equal(tokens[1:], labels[:-1]) and mask.dtype == torch.float32
    answers = [m["content"][0]["text"] for m in messages if m["role"] == "assistant"]
    assert chat.hf.decode(labels[mask.bool()].tolist()) == "".join(a + "<|im_end|>" for a in answers)
    # The image placeholder became 4 pads between vision start/end, none of them a target.
    pads = (tokens == chat.vision.image_token_id).nonzero().flatten().tolist()
    assert len(pads) == 4 and pads == list(range(pads[0], pads[0] + 4))
    assert (
        tokens[pads[0] - 1] == chat.vision.vision_start_token_id
        and tokens[pads[-1] + 1] == chat.vision.vision_end_token_id
    )
    assert mask[labels == chat.vision.image_token_id].sum() == 0


def test_chatml_templates_without_generation_tags_mask_the_same(chat: ChatTokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_chat_tokenizer()))
    hf.chat_template = hf.chat_template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    plain = ChatTokenizer(hf)
    assert not plain._generation_mask and chat._generation_mask
    for record in _records()[::17]:
        n = len(_media(record))
        assert plain.encode(record["messages"], [3] * n) == chat.encode(record["messages"], [3] * n)


def test_placeholder_count_mismatch_is_an_error(chat: ChatTokenizer) -> None:
    with pytest.raises(ValueError, match="1 media placeholders for 2 images"):
        chat.encode(_dialogue(), [4, 4])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        chat.encode([{"role": "robot", "content": "hi"}])


HF_SETTINGS = [
    dict(min_pixels=56 * 56, max_pixels=28 * 28 * 1280),  # Qwen2.5-VL defaults
    dict(min_pixels=56 * 56, max_pixels=112 * 112),
    dict(min_pixels=128 * 28 * 28, max_pixels=256 * 28 * 28),
    dict(min_pixels=32 * 32, max_pixels=64 * 64, patch_size=8, merge_size=2, temporal_patch_size=2),
]


@pytest.mark.parametrize("settings", HF_SETTINGS, ids=["defaults", "small", "upscale", "patch8"])
def test_image_patches_equal_hf_qwen2vl_image_processor(settings: dict) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = VisionProcessorConfig(**settings)
    hf = Qwen2VLImageProcessorPil(**settings)
    images = [Image.open(SAMPLE / p) for p in ("images/coffee.jpg", "images/camera.jpg", "digits/0662.png")]
    expected = hf(images=images, return_tensors="pt")
    for i, image in enumerate(images):
        pixels, grid = process_image(image, config)
        rows = slice(int(expected["image_grid_thw"][:i].prod(-1).sum()), None)
        assert torch.equal(grid, expected["image_grid_thw"][i])
        assert pixels.shape == (int(grid.prod()), config.patch_dim)
        torch.testing.assert_close(
            pixels, expected["pixel_values"][rows][: pixels.shape[0]], rtol=0, atol=1e-5
        )


def test_video_of_repeated_frames_equals_the_image() -> None:
    config = VisionProcessorConfig(
        min_pixels=56 * 56, max_pixels=112 * 112, video_min_pixels=56 * 56, video_max_pixels=112 * 112
    )
    image = Image.open(SAMPLE / "images/rocket.jpg")
    video_pixels, video_grid = process_video([image, image], config)
    image_pixels, image_grid = process_image(image, config)
    assert torch.equal(video_grid, image_grid) and torch.equal(video_pixels, image_pixels)
    # 3 frames: 2 temporal groups, the last frame repeated to fill the second.
    frames = sorted((SAMPLE / "videos/pan-coffee").glob("*.jpg"))[:3]
    pixels, grid = process_video([Image.open(f) for f in frames], config)
    assert grid[0] == 2 and pixels.shape[0] == int(grid.prod())
    last, _ = process_video([Image.open(frames[2])] * 2, config)
    assert torch.equal(pixels[pixels.shape[0] // 2 :], last)


def test_config_from_hf_processor_dicts() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    assert VisionProcessorConfig.from_hf(Qwen2VLImageProcessorPil().to_dict()) == VisionProcessorConfig()
    settings = HF_SETTINGS[-1]
    video = {"size": {"shortest_edge": 16 * 16, "longest_edge": 48 * 48}}
    config = VisionProcessorConfig.from_hf(Qwen2VLImageProcessorPil(**settings).to_dict(), video)
    assert config == VisionProcessorConfig(**settings, video_min_pixels=16 * 16, video_max_pixels=48 * 48)
