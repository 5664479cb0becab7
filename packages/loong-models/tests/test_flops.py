"""The one FLOP count (loong_models.flops) against hand counts on tiny configs, and against the
windows the ViT really attends over."""

import pytest
import torch

from loong_models import load_model_config
from loong_models.image_encoder.grid import frame_cu_seqlens, window_partition

# three ViT layers, the middle one full attention; windows of 28 px = one 2x2 merge block
VLM = load_model_config("tiny-vlm", ["image_encoder.num_layers=3", "image_encoder.window_size=28",
                                     "image_encoder.fullatt_block_indexes=[1]"])  # fmt: skip


def test_text_flops_count_each_samples_own_attention():
    f = VLM.foundation
    n, lh = f.num_active_parameters(), f.num_layers * f.hidden_size
    assert VLM.training_flops(VLM.work([5, 3])) == 6 * n * 8 + 6 * lh * (5 * 5 + 3 * 3)
    # fixed rows of s tokens: DESIGN.md's (6 N + 6 L h s) per token
    assert VLM.training_flops(VLM.work([16] * 4)) == f.flops_per_token(16) * 64


def test_vision_flops_by_hand():
    e, p = VLM.image_encoder, VLM.image_projector
    n_enc, n_proj = e.num_parameters(), p.num_parameters(e.hidden_size, 2, VLM.foundation.hidden_size)
    # one 4 x 6 patch image: 24 patches; full layer: 24 x 24 pairs; two window layers: six windows of 4 patches
    vision = 6 * n_enc * 24 + 6 * n_proj * 24 / 4 + 12 * e.hidden_size * (1 * 24 * 24 + 2 * 6 * 4 * 4)
    text = VLM.training_flops(VLM.work([10]))
    assert VLM.training_flops(VLM.work([10], [(1, 4, 6)])) == pytest.approx(text + vision)
    # a two-frame video: attention stays within each frame, so twice the image
    assert VLM.training_flops(VLM.work([10], [(2, 4, 6)])) == pytest.approx(text + 2 * vision)


@pytest.mark.parametrize(
    "window_px, grid", [(28, (1, 4, 6)), (56, (1, 6, 10)), (56, (2, 8, 4)), (112, (1, 10, 14))]
)
def test_attention_pairs_are_the_windows_the_vit_attends(window_px, grid):
    cfg = load_model_config("tiny-vlm", [f"image_encoder.window_size={window_px}"])
    e = cfg.image_encoder
    work = cfg.work([], [grid])
    grid_thw = torch.tensor([grid])
    _, cu, _ = window_partition(
        grid_thw, e.spatial_merge_size, window_px // (e.spatial_merge_size * e.patch_size)
    )
    assert work.window_pairs == int((torch.diff(cu) ** 2).sum())
    frames, _ = frame_cu_seqlens(grid_thw)
    assert work.full_pairs == int((torch.diff(frames) ** 2).sum())
    assert work.patches == grid[0] * grid[1] * grid[2]


def test_an_encoder_without_windows_attends_whole_frames_in_every_layer():
    cfg = load_model_config("siglip-qwen3-1.7b", ["image_encoder.num_layers=2", "foundation.num_layers=1"])
    e = cfg.image_encoder
    work = cfg.work([], [(1, 4, 4)])
    assert work.window_pairs == 0
    vision = cfg.training_flops(work) - cfg.training_flops(cfg.work([]))
    proj = cfg.image_projector.num_parameters(e.hidden_size, e.spatial_merge_size, cfg.foundation.hidden_size)
    m2 = e.spatial_merge_size**2
    assert vision == pytest.approx(
        6 * e.num_parameters() * 16 + 6 * proj * 16 / m2 + 12 * e.hidden_size * 2 * 16 * 16
    )
