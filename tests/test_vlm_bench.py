"""The CPU-cheap parts of bench/vlm_throughput.py: parameter and FLOP accounting against a real
(tiny, random) HF Qwen2.5-VL, and the translation of a packed micro-batch into HF inputs."""

import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from vlm_flops import real_tokens, step_counts, text_only_ceiling  # noqa: E402
from vlm_throughput import bench_shape, hf_batch, hf_config, hf_inputs, unpack  # noqa: E402

from loong_models import load_model_config

# the zoo's tiny VLM with a one-layer ViT whose windows (28 px) are smaller than the test images
MODEL = load_model_config(
    "tiny-vlm",
    [
        "image_encoder.num_layers=3",
        "image_encoder.window_size=28",
        "image_encoder.fullatt_block_indexes=[1]",
        "foundation.num_layers=2",
        "foundation.family=qwen2",
    ],
)  # qkv biases, as HF Qwen2.5-VL
TINY = bench_shape(MODEL)
IDS = asdict(MODEL.vision_token_ids)
IMG, VID, VS, VE = (
    IDS[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
)


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_counts_match_hf_and_loong(tie):
    """HF built from the bench's shape has the parameters Loong's config counts, component by component."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    shape = replace(TINY, text=replace(TINY.text, tie_embeddings=tie))
    model = Qwen2_5_VLForConditionalGeneration(hf_config(shape, IDS))
    visual = model.model.visual
    merger = sum(p.numel() for p in visual.merger.parameters())
    tower = sum(p.numel() for p in visual.parameters()) - merger
    total = sum(p.numel() for p in model.parameters())
    assert total - tower - merger == shape.text.num_parameters()
    e = MODEL.image_encoder
    assert tower == e.num_parameters()
    assert merger == MODEL.image_projector.num_parameters(
        e.hidden_size, e.spatial_merge_size, MODEL.foundation.hidden_size
    )
    if tie == MODEL.foundation.tie_word_embeddings:
        assert shape.text.num_parameters() == MODEL.foundation.num_parameters()


def _packed():
    tokens = torch.tensor([[5, VS, IMG, IMG, VE, 7, 8, 0, 0]])
    return {
        "tokens": tokens,
        "labels": torch.tensor([[VS, IMG, IMG, VE, 7, 8, 9, 0, 0]]),
        "loss_mask": torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.float32),
        "cu_seqlens": torch.tensor([0, 7, 9], dtype=torch.int32),
        "pixel_values": torch.zeros(8, TINY.vision.patch_dim),
        "image_grid_thw": torch.tensor([[1, 2, 4]]),
    }


def test_hf_inputs_shift_labels_and_mark_images():
    inputs = hf_inputs(_packed(), image_token_id=IMG, video_token_id=VID)
    # HF predicts labels[i + 1] at position i: the contract's target of position 4 (token 7) sits at 5
    assert inputs["labels"].tolist() == [[-100, -100, -100, -100, -100, 7, 8, 9, -100]]
    assert inputs["mm_token_type_ids"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 0, 0]]
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 4]]
    mb = {
        **_packed(),
        "pixel_values_videos": torch.zeros(0, TINY.vision.patch_dim),
        "video_grid_thw": torch.zeros(0, 3),
    }
    assert "pixel_values_videos" not in hf_inputs(mb, IMG, VID)  # empty media are left out, as HF needs


def test_step_counts_exclude_padding_and_use_the_models_flop_count():
    mb = _packed()
    assert real_tokens(mb, pad_id=0) == 7
    counts = step_counts([mb, mb], MODEL, pad_id=0)
    assert (counts.tokens, counts.images, counts.patches) == (14, 2, 16)
    assert counts.token_pairs == 2 * 7 * 7  # attention over the real sample, not the 9-token pack
    assert counts.flops == MODEL.training_flops(MODEL.work([7, 7], [(1, 2, 4), (1, 2, 4)]))
    assert counts.vision_flops == pytest.approx(counts.flops - MODEL.training_flops(MODEL.work([7, 7])))


def test_the_text_only_ceiling_is_the_ratio_of_flops_per_token():
    """At equal MFU the mix's LLM tokens/s over the text-only tokens/s is the inverse ratio of
    their FLOPs per token: an image token also pays the ViT over its merge**2 patches."""
    mb = _packed()
    with_images = asdict(step_counts([mb, mb], MODEL, pad_id=0))
    text = {**mb, "pixel_values": torch.zeros(0, TINY.vision.patch_dim), "image_grid_thw": torch.zeros(0, 3, dtype=torch.long)}
    text_only = asdict(step_counts([text, text], MODEL, pad_id=0))
    assert text_only["vision_flops"] == 0 and text_only["tokens"] == with_images["tokens"]
    ceiling = text_only_ceiling([with_images], [text_only])
    assert ceiling == pytest.approx(1 - with_images["vision_flops"] / with_images["flops"])
    assert 0 < ceiling < 1
    assert text_only_ceiling([text_only], [text_only]) == 1.0


def test_the_bench_refuses_runs_that_saw_different_data():
    from vlm_throughput import Row, check_same_data

    def row(name, **change):
        counts = [{"tokens": 100, "images": 4, "samples": 2, "digest": 11}, {"tokens": 120, "images": 4, "samples": 2,
                  "digest": 22}, {"tokens": 90, "images": 3, "samples": 2, "digest": 33}]  # fmt: skip
        for key, (step, value) in change.items():
            counts[step - 1][key] = value
        return Row(name, [1.0] * 3, 1.0, counts)

    check_same_data([row("loong"), row("hf")])
    for change, what in [({"digest": (2, 23)}, "step 2 digest 22 != 23"), ({"tokens": (2, 121)}, "step 2 tokens"),
                         ({"images": (3, 2)}, "step 3 images"), ({"samples": (1, 3)}, "step 1 samples")]:  # fmt: skip
        with pytest.raises(SystemExit, match=what):
            check_same_data([row("loong"), row("hf", **change)])
    short = Row("hf", [1.0] * 2, 1.0, row("x").counts[:2])
    with pytest.raises(SystemExit, match="ran 3 steps"):
        check_same_data([row("loong"), short])


def test_hf_loss_is_the_contract_loss():
    """The shifted labels make HF's own loss the mean next-token loss over loss-mask positions."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(hf_config(TINY, IDS)).eval()
    mb = _packed()
    mb["pixel_values"] = torch.randn(8, TINY.vision.patch_dim)
    with torch.no_grad():
        out = model(**hf_inputs(mb, IMG, VID))
        logp = out.logits[0].float().log_softmax(-1)
    mask = mb["loss_mask"][0].bool()
    ref = -logp[mask].gather(1, mb["labels"][0][mask][:, None]).mean()
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)


def test_bench_data_feeds_both_stacks_the_same_images(tmp_path):
    """The bench's JSONL (bundled photos at a fixed size, several per sample, real captions) goes
    through the train app's multimodal path into micro-batches with the expected grids."""
    import argparse

    from vlm_throughput import compose, train_overrides, write_bench_data

    from loong_train.trainer import run_data, step_layout

    jsonl = write_bench_data(tmp_path / "data", image_size=56, images_per_sample=3, num_samples=8)
    args = argparse.Namespace(model="tiny-vlm", text_layers=2, vision_layers=2, image_size=56, num_samples=8,
                              seq=256, samples_per_step=4, dtype="fp32", model_overrides=[])  # fmt: skip
    cfg = compose(train_overrides(args, jsonl, tmp_path))
    assert cfg.model.foundation.num_layers == 2 and cfg.data.multimodal.max_pixels == 56 * 56
    cfg.train.global_batch_size, cfg.train.seed = 4, 0
    data = run_data(cfg, step_layout(cfg, num_microbatches=4))
    mbs = next(data.train_steps())
    grids = torch.cat([mb["image_grid_thw"] for mb in mbs])
    assert grids.tolist() == [[1, 4, 4]] * 12  # 4 samples x 3 images, 56 px / patch 14
    image_tokens = sum(int((mb["tokens"] == cfg.model.image_token_id).sum()) for mb in mbs)
    assert image_tokens == 12 * 4  # 16 patches / merge 2x2 per image
    assert sum(mb["pixel_values"].shape[0] for mb in mbs) == 12 * 16
    # the digest both stacks report: the same for the same step's micro-batches, another for the next
    from loong_data.step_data import batch_digest

    steps = run_data(cfg, step_layout(cfg, num_microbatches=4)).train_steps()
    assert batch_digest(next(steps)) == batch_digest(mbs) != batch_digest(next(steps))


def _two_samples():
    """A pack of two samples (the first with a 2x4-patch image, the second text only) + padding."""
    tokens = torch.tensor([[5, VS, IMG, IMG, VE, 7, 8, 11, 12, 13, 0, 0]])
    return {
        "tokens": tokens,
        "labels": torch.tensor([[VS, IMG, IMG, VE, 7, 8, 9, 12, 13, 14, 0, 0]]),
        "loss_mask": torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0, 1, 1, 0, 0]], dtype=torch.float32),
        "cu_seqlens": torch.tensor([0, 7, 10, 12], dtype=torch.int32),
        "pixel_values": torch.randn(8, TINY.vision.patch_dim),
        "image_grid_thw": torch.tensor([[1, 2, 4]]),
        "pixel_values_videos": torch.zeros(0, TINY.vision.patch_dim),
        "video_grid_thw": torch.zeros(0, 3, dtype=torch.int64),
    }


def test_hf_batches_hold_the_packed_samples_and_give_their_loss():
    """HF is fed the pack's samples as an HF user batches them (padded to the longest, attention
    mask): the same tokens and images, and HF's loss is the mean over the same loss tokens as
    each sample alone."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    mb = _two_samples()
    samples = unpack(mb, 0, IMG, VID, merge=2)
    assert [s["tokens"].tolist() for s in samples] == [[5, VS, IMG, IMG, VE, 7, 8], [11, 12, 13]]
    assert samples[0]["image_grid_thw"].tolist() == [[1, 2, 4]] and samples[1]["image_grid_thw"].numel() == 0
    assert torch.equal(samples[0]["pixel_values"], mb["pixel_values"])
    batch = hf_batch(samples, 0, IMG, VID)
    assert batch["attention_mask"].tolist() == [[1] * 7 + [0], [1] * 3 + [0] * 5]
    assert batch["labels"].tolist() == [[-100, -100, -100, -100, -100, 7, 8, 9], [-100, -100, 13, 14] + [-100] * 4]
    model = Qwen2_5_VLForConditionalGeneration(hf_config(TINY, IDS)).eval()
    with torch.no_grad():
        together = model(**batch).loss
        alone = [model(**hf_batch([s], 0, IMG, VID)).loss for s in samples]
    assert together.item() == pytest.approx(((3 * alone[0] + 2 * alone[1]) / 5).item(), rel=1e-5)


def test_text_only_bench_data_has_the_lengths_of_the_image_samples_without_images(tmp_path):
    """--text-only trains the same LLM on text packs of the same length: every image of a sample
    becomes text of as many tokens (within a few), and no pack holds an image."""
    import argparse

    from vlm_throughput import compose, train_overrides, write_bench_data

    from loong_train.trainer import run_data, step_layout

    args = argparse.Namespace(model="tiny-vlm", text_layers=2, vision_layers=2, image_size=56, num_samples=8,
                              seq=256, samples_per_step=4, dtype="fp32", model_overrides=[])  # fmt: skip
    lengths = {}
    for text_only in (False, True):
        work = tmp_path / str(text_only)
        jsonl = write_bench_data(work / "data", image_size=56, images_per_sample=3, num_samples=8, text_only=text_only)
        cfg = compose(train_overrides(args, jsonl, work))
        data = run_data(cfg, step_layout(cfg, num_microbatches=4))
        mbs = next(data.train_steps())
        assert sum(mb["image_grid_thw"].shape[0] for mb in mbs) == (0 if text_only else 12)
        segments = [(mb["tokens"][0], lo, hi) for mb in mbs
                    for lo, hi in zip(mb["cu_seqlens"][:-1].tolist(), mb["cu_seqlens"][1:].tolist())]  # fmt: skip
        lengths[text_only] = sorted(hi - lo for t, lo, hi in segments if (t[lo:hi] != data.tokenizer.pad_id).any())
    assert len(lengths[True]) == len(lengths[False])
    for text, image in zip(lengths[True], lengths[False]):
        assert abs(text - image) <= 3 * 3, (text, image)  # 3 images, a word's tokens of slack each
