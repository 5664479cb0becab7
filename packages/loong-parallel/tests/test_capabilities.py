"""A run's keys that need an optional accelerator feature are refused on a backend without it,
naming the key, the backend and the feature; a run that asks for none passes everywhere."""

import pytest

from loong_models import FoundationConfig, ModelConfig
from loong_models.precision import PrecisionConfig
from loong_models.specs import te_installed
from loong_parallel import ParallelConfig, require_features
from loong_parallel.capabilities import FEATURE_KEYS
from loong_xpu import FEATURES, UnsupportedFeatureError, get_accelerator
from loong_xpu.backends.cuda import CudaAccelerator, fp8_recipes_for

ASKS_FOR = [
    (ModelConfig(layer_backend="te"), ParallelConfig(), "model.layer_backend=te", "te"),
    (ModelConfig(), ParallelConfig(moe_a2a_overlap=True), "parallel.moe_a2a_overlap=true", "side_streams"),
    (ModelConfig(), ParallelConfig(moe_shared_expert_overlap=True), "parallel.moe_shared_expert_overlap=true",
     "side_streams"),
    (ModelConfig(), ParallelConfig(offload_activations=["core_attn"]), "parallel.offload_activations", "side_streams"),
]  # fmt: skip


@pytest.mark.parametrize(("model", "parallel", "key", "feature"), ASKS_FOR, ids=[k for _, _, k, _ in ASKS_FOR])
def test_a_key_asking_for_a_missing_feature_is_refused_by_name(model, parallel, key, feature):
    with pytest.raises(UnsupportedFeatureError, match=rf"^{key}: the 'cpu' accelerator does not support '{feature}'"):
        require_features(model, parallel, get_accelerator("cpu"))


@pytest.mark.parametrize(("model", "parallel", "key", "feature"), ASKS_FOR, ids=[k for _, _, k, _ in ASKS_FOR])
def test_a_backend_with_the_feature_accepts_the_key(model, parallel, key, feature):
    require_features(model, parallel, CudaAccelerator())  # the class has every feature; no device used


def test_a_run_that_asks_for_no_feature_passes_on_the_cpu():
    require_features(ModelConfig(layer_backend="local"), ParallelConfig(), get_accelerator("cpu"))


def test_every_feature_key_names_a_known_feature():
    assert {feature for _, _, feature in FEATURE_KEYS} <= set(FEATURES)


class Hopper(CudaAccelerator):
    """The CUDA backend's view of an H100 (compute capability 9.0), without touching a device."""

    def fp8_recipes(self) -> frozenset[str]:
        return fp8_recipes_for((9, 0))

    def device_name(self) -> str:
        return "NVIDIA H100 80GB HBM3"


def fp8_model(**precision) -> ModelConfig:
    return ModelConfig(foundation=FoundationConfig(precision=PrecisionConfig(**precision)))


def test_fp8_off_cuda_is_refused_naming_the_key():
    with pytest.raises(UnsupportedFeatureError, match=r"^model.foundation.precision.fp8=on: the 'cpu' accelerator does not support 'fp8'"):
        require_features(fp8_model(fp8="on"), ParallelConfig(), get_accelerator("cpu"))


def test_mxfp8_on_hopper_is_refused_naming_the_recipe_key():
    with pytest.raises(UnsupportedFeatureError, match=r"^model.foundation.precision.recipe=mxfp8: 'NVIDIA H100 80GB HBM3' "
                       r"cannot run it; it runs: blockwise, delayed, tensorwise"):  # fmt: skip
        require_features(fp8_model(fp8="on", recipe="mxfp8"), ParallelConfig(), Hopper())


@pytest.mark.skipif(te_installed(), reason="checks the refusal without transformer-engine")
def test_fp8_without_transformer_engine_is_refused_naming_the_key():
    with pytest.raises(UnsupportedFeatureError, match=r"^model.foundation.precision.fp8=on needs Transformer Engine layers"):
        require_features(fp8_model(fp8="on", recipe="blockwise"), ParallelConfig(), Hopper())


def test_the_fp8_recipes_follow_the_compute_capability():
    assert fp8_recipes_for((8, 0)) == frozenset()  # A100: no FP8 tensor cores
    assert fp8_recipes_for((8, 9)) == {"delayed", "tensorwise"}
    assert fp8_recipes_for((9, 0)) == {"delayed", "tensorwise", "blockwise"}
    assert fp8_recipes_for((10, 0)) == {"delayed", "tensorwise", "blockwise", "mxfp8"}
    assert get_accelerator("cpu").fp8_recipes() == frozenset()


@pytest.mark.parametrize(("model", "parallel", "key"), [
    (ModelConfig(attention_backend="fused"), ParallelConfig(), "model.attention_backend"),
    (ModelConfig(grouped_gemm_kernel="cutlass"), ParallelConfig(), "model.grouped_gemm_kernel"),
    (ModelConfig(), ParallelConfig(moe_delay_wgrad=True), "parallel.moe_delay_wgrad=true"),
])  # fmt: skip
def test_te_levers_are_refused_off_cuda_and_on_local_layers_naming_the_key(model, parallel, key):
    with pytest.raises(UnsupportedFeatureError, match=rf"^{key}: the 'cpu' accelerator does not support 'te'"):
        require_features(model, parallel, get_accelerator("cpu"))
    model.layer_backend = "local"
    with pytest.raises(UnsupportedFeatureError, match=rf"^{key} needs Transformer Engine layers, but model.layer_backend=local"):
        require_features(model, parallel, Hopper())


def test_the_attention_backend_choice_becomes_megatrons_field():
    from megatron.core.transformer.enums import AttnBackend

    from loong_models.specs import attention_backend_fields

    assert attention_backend_fields("auto") == {}
    assert attention_backend_fields("fused") == {"attention_backend": AttnBackend.fused}
    assert attention_backend_fields("flash") == {"attention_backend": AttnBackend.flash}
