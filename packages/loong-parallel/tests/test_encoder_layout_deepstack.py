"""A layout that moves only the encoder's last-layer tokens refuses a DeepStack VLM up front."""

from loong_models import load_model_config
from loong_parallel.encoder_layout import encoder_layout_errors


def test_hetero_dp_refuses_deepstack_naming_the_keys():
    qwen3 = load_model_config("tiny-qwen3-vl", ["image_encoder.tensor_model_parallel_size=1"])
    (error,) = encoder_layout_errors("hetero_dp", qwen3, tp=2)
    assert "deepstack_visual_indexes" in error and "parallel.encoder_layout=shared" in error
    qwen25 = load_model_config("tiny-vlm", ["image_encoder.tensor_model_parallel_size=1"])
    assert encoder_layout_errors("hetero_dp", qwen25, tp=2) == []
