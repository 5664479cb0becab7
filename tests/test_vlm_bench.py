"""The CPU-cheap parts of bench/vlm_throughput.py: parameter and FLOP accounting against a real
(tiny, random) HF Qwen2.5-VL, and the translation of a packed micro-batch into HF inputs."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from vlm_flops import VisionShape, real_tokens, step_counts, vision_flops  # noqa: E402
from vlm_throughput import BenchShape, TextShape, hf_config, hf_inputs  # noqa: E402

TINY = BenchShape(
    text=TextShape(num_layers=2, hidden=64, ffn=96, heads=4, kv_heads=2, vocab=300, mrope_section=(2, 3, 3)),
    vision=VisionShape(depth=3, hidden=32, ffn=48, out_hidden=64, patch=4, window_size=8, fullatt_blocks=(1,)),
    vision_heads=2,
)
IDS = dict(image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293)


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_counts_match_hf(tie):
    from transformers import Qwen2_5_VLForConditionalGeneration

    shape = replace(TINY, text=replace(TINY.text, tie_embeddings=tie))
    model = Qwen2_5_VLForConditionalGeneration(hf_config(shape, IDS))
    visual = model.model.visual
    merger = sum(p.numel() for p in visual.merger.parameters())
    tower = sum(p.numel() for p in visual.parameters()) - merger
    assert (tower, merger) == (shape.vision.block_params(), shape.vision.merger_params())
    total = sum(p.numel() for p in model.parameters())
    assert total - tower - merger == shape.text.num_parameters()


def test_vision_flops_by_hand():
    v = TINY.vision  # window 8 px / patch 4 = 2x2 patches; one full layer, two windowed
    grid = torch.tensor([[1, 4, 6]])  # 24 patches in one frame
    expected = (6 * v.block_params() * 24 + 6 * v.merger_params() * 24 / 4
                + 12 * v.hidden * 24 * (1 * 24 + 2 * 4))  # fmt: skip
    assert vision_flops(v, grid) == pytest.approx(expected)
    # two frames: full attention spans one frame, not the whole video
    assert vision_flops(v, torch.tensor([[2, 4, 6]])) == pytest.approx(2 * expected)


def _packed():
    tokens = torch.tensor([[5, 292, 290, 290, 293, 7, 8, 0, 0]])
    return {
        "tokens": tokens,
        "labels": torch.tensor([[292, 290, 290, 293, 7, 8, 9, 0, 0]]),
        "loss_mask": torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.float32),
        "cu_seqlens": torch.tensor([0, 7, 9], dtype=torch.int32),
        "pixel_values": torch.zeros(8, TINY.vision.patch_dim),
        "image_grid_thw": torch.tensor([[1, 2, 4]]),
    }


def test_hf_inputs_shift_labels_and_mark_images():
    inputs = hf_inputs(_packed(), image_token_id=290, video_token_id=291)
    # HF predicts labels[i + 1] at position i: the contract's target of position 4 (token 7) sits at 5
    assert inputs["labels"].tolist() == [[-100, -100, -100, -100, -100, 7, 8, 9, -100]]
    assert inputs["mm_token_type_ids"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 0, 0]]
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 4]]


def test_step_counts_exclude_padding():
    mb = _packed()
    assert real_tokens(mb, pad_id=0) == 7
    counts = step_counts([mb, mb], TINY.vision, pad_id=0)
    assert (counts.tokens, counts.images, counts.patches) == (14, 2, 16)
    assert counts.vision_flops == pytest.approx(2 * vision_flops(TINY.vision, mb["image_grid_thw"]))


def test_hf_loss_is_the_contract_loss():
    """The shifted labels make HF's own loss the mean next-token loss over loss-mask positions."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(hf_config(TINY, IDS)).eval()
    mb = _packed()
    mb["pixel_values"] = torch.randn(8, TINY.vision.patch_dim)
    with torch.no_grad():
        out = model(**hf_inputs(mb, 290, 291))
        logp = out.logits[0].float().log_softmax(-1)
    mask = mb["loss_mask"][0].bool()
    ref = -logp[mask].gather(1, mb["labels"][0][mask][:, None]).mean()
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
