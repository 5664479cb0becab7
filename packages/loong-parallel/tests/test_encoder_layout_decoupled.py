"""parallel.encoder_layout=decoupled is refused when the config is validated, naming the key,
wherever its schedule is not built (no pipeline, interleaved stages, context parallelism,
overlapped gradient reduction, an encoder sharded over TP, DeepStack)."""

import pytest

from loong_models import load_model_config
from loong_parallel import ParallelConfig
from loong_parallel.encoder_layout import encoder_layout_errors, encoder_on_every_stage


def validate(**kw) -> None:
    ParallelConfig(encoder_layout="decoupled", **kw).validate(
        8, num_layers=4, num_heads=4, num_query_groups=2
    )


@pytest.mark.parametrize(
    ("shape", "key"),
    [(dict(pp=1, tp=2), "parallel.pp > 1"), (dict(pp=2, vpp=2), "parallel.vpp=2"), (dict(pp=2, cp=2), "parallel.cp=2"),
     (dict(pp=2, overlap_grad_reduce=True), "parallel.overlap_grad_reduce=True")],
)  # fmt: skip
def test_decoupled_refuses_layouts_it_cannot_schedule_naming_the_key(shape, key):
    with pytest.raises(ValueError, match="parallel.encoder_layout=decoupled") as e:
        validate(**shape)
    assert key in str(e.value)


def test_decoupled_accepts_pipeline_stages_with_or_without_tensor_parallelism():
    validate(pp=2)
    validate(pp=2, tp=2, sequence_parallel=True)


def test_decoupled_needs_a_replicated_encoder_without_deepstack():
    vlm = load_model_config("tiny-vlm")
    assert encoder_layout_errors("decoupled", vlm, tp=1) == []  # null encoder TP = the foundation's 1
    (error,) = encoder_layout_errors("decoupled", vlm, tp=2)
    assert "model.image_encoder.tensor_model_parallel_size=1" in error
    assert (
        encoder_layout_errors(
            "decoupled", load_model_config("tiny-vlm", ["image_encoder.tensor_model_parallel_size=1"]), tp=2
        )
        == []
    )
    qwen3 = load_model_config("tiny-qwen3-vl", ["image_encoder.tensor_model_parallel_size=1"])
    (error,) = encoder_layout_errors("decoupled", qwen3, tp=2)
    assert "deepstack_visual_indexes" in error
    assert encoder_on_every_stage("decoupled") and not encoder_on_every_stage("hetero_dp")
