"""Streaming packed multimodal batches from real WebDataset shards of the bundled sample."""

import io
import itertools
import json
from pathlib import Path

import pytest
import torch
import webdataset as wds

from loong_data.multimodal import (
    ChatTokenizer,
    MultimodalDataError,
    PackedMultimodalDataset,
    VisionProcessorConfig,
    collate_multimodal,
    convert_to_webdataset,
    default_multimodal_dataset,
    encode_sample,
    load_chat_tokenizer,
)

SEQ_LEN = 256
# Small images (at most 8x8 patches = 16 tokens) keep packs of several samples in 256 tokens.
CONFIG = VisionProcessorConfig(
    min_pixels=56 * 56, max_pixels=112 * 112, video_min_pixels=56 * 56, video_max_pixels=84 * 84
)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vlm") / "shards"
    convert_to_webdataset(
        [default_multimodal_dataset() / "conversations.jsonl"], out, maxcount=50, progress=False
    )
    return out


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return load_chat_tokenizer()


def _dataset(shards, chat, **kwargs) -> PackedMultimodalDataset:
    return PackedMultimodalDataset(
        shards, chat, **{"seq_length": SEQ_LEN, "processor": CONFIG, "seed": 0, **kwargs}
    )


def test_packs_fill_seq_len_and_media_match_placeholders(shards: Path, chat: ChatTokenizer) -> None:
    _check_packs(_dataset(shards, chat, pack_buffer=32), chat, 12)


def test_video_packs(tmp_path: Path, chat: ChatTokenizer) -> None:
    # The 12 video and mixed (image + video) conversations of the bundled sample.
    sample = default_multimodal_dataset()
    lines = [line for line in (sample / "conversations.jsonl").read_text().splitlines() if '"video"' in line]
    (tmp_path / "videos.jsonl").write_text("\n".join(lines) + "\n")
    convert_to_webdataset([tmp_path / "videos.jsonl"], tmp_path / "shards", media_root=sample, progress=False)
    batches = _check_packs(_dataset(tmp_path / "shards", chat), chat, 2)
    grids = torch.cat([b["video_grid_thw"] for b in batches])
    # 8 frames of 96x96 -> 84x84: 4 temporal groups of 6x6 patches.
    assert len(grids) >= 6 and all(g.tolist() == [4, 6, 6] for g in grids)


def _check_packs(data: PackedMultimodalDataset, chat: ChatTokenizer, n: int) -> list[dict]:
    batches = list(itertools.islice(iter(data), n))
    for batch in batches:
        tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"]
        assert tokens.shape == labels.shape == mask.shape == batch["position_ids"].shape == (1, SEQ_LEN)
        cu = batch["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == SEQ_LEN
        assert batch["max_seqlen"] == int((cu[1:] - cu[:-1]).max()) <= SEQ_LEN
        for pad, pv, grid in (
            (chat.vision.image_token_id, "pixel_values", "image_grid_thw"),
            (chat.vision.video_token_id, "pixel_values_videos", "video_grid_thw"),
        ):
            g = batch[grid]
            assert g.dtype == torch.int64 and g.shape[1] == 3
            assert batch[pv].shape == (int(g.prod(-1).sum()), CONFIG.patch_dim)
            assert int((tokens == pad).sum()) == int(g.prod(-1).sum()) // CONFIG.merge_size**2
        # Targets are assistant tokens only: never a media pad, a user-turn token or padding.
        assert (
            mask[labels == chat.vision.image_token_id].sum() == 0
            and mask[labels == chat.im_start_id].sum() == 0
        )
        assert (mask == 0).sum() > 0 and (mask == 1).sum() > 0
        # One vision span per media, each a run of pads between start and end.
        starts = (tokens[0] == chat.vision.vision_start_token_id).nonzero().flatten()
        assert len(starts) == batch["image_grid_thw"].shape[0] + batch["video_grid_thw"].shape[0]
    return batches


def test_pack_pixels_equal_hf_processor_in_order(shards: Path, chat: ChatTokenizer) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil(min_pixels=CONFIG.min_pixels, max_pixels=CONFIG.max_pixels)
    data = _dataset(shards, chat)
    pack = next(p for p in data.packs() if sum(len(s.media) for s in p) >= 3)
    batch = data.collate(pack)
    images = [frames[0] for s in pack for kind, frames in s.media if kind == "image"]
    expected = hf(images=images, return_tensors="pt")
    assert torch.equal(batch["image_grid_thw"], expected["image_grid_thw"])
    torch.testing.assert_close(batch["pixel_values"], expected["pixel_values"], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "maxcount,dp_size", [(50, 2), (50, 3), (400, 2)], ids=["shards-2", "shards-3", "one-shard-2"]
)
def test_dp_ranks_read_disjoint_samples(
    shards: Path, tmp_path: Path, chat: ChatTokenizer, maxcount: int, dp_size: int
) -> None:
    if maxcount != 50:  # one shard: ranks split its samples instead of the shards
        shards = tmp_path / "one"
        convert_to_webdataset(
            [default_multimodal_dataset() / "conversations.jsonl"], shards, maxcount=maxcount, progress=False
        )
    keys = []
    for rank in range(dp_size):
        data = _dataset(shards, chat, dp_rank=rank, dp_size=dp_size, shuffle_buffer=16)
        keys.append([f"{Path(s['__url__']).name}#{s['__key__']}" for s in data.raw_samples(epoch=0)])
    assert sum(len(k) for k in keys) == 336 == len(set().union(*keys))
    assert min(len(k) for k in keys) > 336 // dp_size // 2  # every rank gets a share


def test_order_is_seeded_and_resume_skips_exactly(shards: Path, chat: ChatTokenizer) -> None:
    def keys(data: PackedMultimodalDataset, n: int) -> list[list[str]]:
        return [[s.key for s in pack] for pack in itertools.islice(data.packs(), n)]

    first = keys(_dataset(shards, chat), 6)
    assert first == keys(_dataset(shards, chat), 6)
    assert first != keys(_dataset(shards, chat, seed=1), 6)
    full = list(itertools.islice(iter(_dataset(shards, chat)), 5))
    resumed = list(itertools.islice(iter(_dataset(shards, chat, start_pack=3)), 2))
    for a, b in zip(full[3:], resumed):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_epochs_repeat_with_a_new_order(shards: Path, chat: ChatTokenizer) -> None:
    data = _dataset(shards, chat, shuffle_buffer=8)
    epoch0 = [s["__key__"] + s["__url__"] for s in data.raw_samples(0)]
    epoch1 = [s["__key__"] + s["__url__"] for s in data.raw_samples(1)]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1


def _write_shard(path: Path, samples: list[dict]) -> None:
    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)


def _image_sample(key: str, image: bytes) -> dict:
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": "img0.jpg"}, {"type": "text", "text": "What?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Coffee."}]},
    ]
    return {"__key__": key, "json": json.dumps({"messages": messages}).encode(), "img0.jpg": image}


def test_bad_media_in_a_shard_names_shard_and_key(tmp_path: Path, chat: ChatTokenizer) -> None:
    good = (default_multimodal_dataset() / "images/coffee.jpg").read_bytes()
    shard = tmp_path / "bad.tar"
    _write_shard(
        shard, [_image_sample("a", good), _image_sample("b", b"not a jpeg"), _image_sample("c", good)]
    )
    with pytest.raises(MultimodalDataError, match=rf"sample {shard}#b: cannot decode 'img0.jpg'"):
        list(itertools.islice(iter(_dataset(shard, chat, shuffle_buffer=1)), 1))
    data = _dataset(shard, chat, shuffle_buffer=1, on_error="skip")
    batch = next(iter(data))
    assert batch["image_grid_thw"].shape[0] == 2 and data.num_bad == 1
    missing = _image_sample("d", good)
    del missing["img0.jpg"]
    _write_shard(shard, [missing])
    with pytest.raises(MultimodalDataError, match=rf"sample {shard}#d: no file 'img0.jpg' in the sample"):
        list(_dataset(shard, chat).samples(0))


def test_a_damaged_tar_names_the_shard(tmp_path: Path, chat: ChatTokenizer) -> None:
    good = (default_multimodal_dataset() / "images/coffee.jpg").read_bytes()
    shard = tmp_path / "cut.tar"
    _write_shard(shard, [_image_sample(str(i), good) for i in range(3)])
    shard.write_bytes(shard.read_bytes()[: len(good) + 700])  # cut inside the second sample's image
    with pytest.raises(MultimodalDataError, match=rf"shard {shard}: unreadable"):
        list(_dataset(shard, chat, shuffle_buffer=1).samples(0))


def _long_raw(shards: Path) -> dict:
    """The bundled digit-sequence sample with the most images, as stored in the shards."""
    raws = [
        raw
        for shard in sorted(shards.glob("*.tar"))
        for raw in wds.WebDataset(str(shard), shardshuffle=False, empty_check=False)
        if json.loads(raw["json"])["id"].startswith("digit-sequence")
    ]
    return max(raws, key=lambda raw: sum(k.startswith("img") for k in raw))


def test_overflow_policies(shards: Path, chat: ChatTokenizer) -> None:
    raw = _long_raw(shards)
    full = encode_sample(raw, chat, CONFIG, seq_length=SEQ_LEN)
    assert len(full.media) == 4 and len(full) < SEQ_LEN  # 4 digits of 4x4 patches: 4 tokens each
    starts = (full.tokens == chat.vision.vision_start_token_id).nonzero().flatten().tolist()
    limit = starts[2] + 2  # the cut would fall inside the third image
    with pytest.raises(
        MultimodalDataError, match=rf"sample .*#{raw['__key__']}: {len(full)} tokens, more than"
    ):
        encode_sample(raw, chat, CONFIG, seq_length=limit, overflow="error")
    assert encode_sample(raw, chat, CONFIG, seq_length=limit, overflow="skip") is None
    # Truncation keeps no assistant token here (the answer is at the end): the sample is dropped.
    assert encode_sample(raw, chat, CONFIG, seq_length=limit, overflow="truncate") is None


def test_truncation_never_cuts_an_image(chat: ChatTokenizer) -> None:
    good = (default_multimodal_dataset() / "images/coffee.jpg").read_bytes()
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": "img0.jpg"}, {"type": "text", "text": "What?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "A coffee cup on a saucer. " * 3}]},
        {
            "role": "user",
            "content": [{"type": "image", "image": "img1.jpg"}, {"type": "text", "text": "And this?"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "The same cup."}]},
    ]
    raw = {
        "__key__": "k",
        "__url__": "mem",
        "json": json.dumps({"messages": messages}).encode(),
        "img0.jpg": good,
        "img1.jpg": good,
    }
    full = encode_sample(raw, chat, CONFIG, seq_length=1024)
    second = (full.tokens == chat.vision.vision_start_token_id).nonzero().flatten().tolist()[1]
    sample = encode_sample(raw, chat, CONFIG, seq_length=second + 5, overflow="truncate")
    assert len(sample) == second - 1 and len(sample.media) == 1 and len(sample.grids) == 1
    assert int((sample.tokens == chat.vision.image_token_id).sum()) == CONFIG.num_tokens(sample.grids[0])
    assert sample.loss_mask.sum() > 0
    batch = collate_multimodal([sample], CONFIG)
    assert batch["tokens"].shape == (1, len(sample)) and batch["image_grid_thw"].shape == (1, 3)


def test_dataloader_workers_keep_the_order(shards: Path, chat: ChatTokenizer) -> None:
    single = [b["tokens"] for b in itertools.islice(iter(_dataset(shards, chat, pack_buffer=16)), 4)]
    loader = torch.utils.data.DataLoader(
        _dataset(shards, chat, pack_buffer=16), batch_size=None, num_workers=2
    )
    multi = [b["tokens"] for b in itertools.islice(iter(loader), 4)]
    assert all(torch.equal(a, b) for a, b in zip(single, multi))


def test_image_in_pack_decodes_to_the_original(shards: Path, chat: ChatTokenizer) -> None:
    # A sample's media are the member files of its tar entry, decoded in order of appearance.
    raw = _long_raw(shards)
    sample = encode_sample(raw, chat, CONFIG, seq_length=SEQ_LEN)
    from PIL import Image

    for i, (kind, frames) in enumerate(sample.media):
        original = Image.open(io.BytesIO(raw[f"img{i}.png"])).convert("RGB")
        assert kind == "image" and frames[0].tobytes() == original.tobytes()
