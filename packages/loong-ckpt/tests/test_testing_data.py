"""loong_ckpt.testing finds loong-data's bundled photo through loong-data (package data), so the
helpers work from an installed wheel as from the repository."""

from pathlib import Path

import loong_data.bundled
from loong_ckpt.testing.hf_models import IMAGE, vlm_inputs


def test_the_tiny_vlms_photo_is_loong_datas_bundled_file():
    assert IMAGE.is_file() and IMAGE.is_relative_to(Path(loong_data.bundled.__file__).parent)


def test_the_photo_becomes_image_patches_and_their_tokens():
    inputs = vlm_inputs()
    t, h, w = inputs["image_grid_thw"][0].tolist()
    assert t * h * w == inputs["pixel_values"].shape[0] and int((inputs["input_ids"] == 990).sum()) == t * h * w // 4
