"""A run's keys that need an optional accelerator feature are refused on a backend without it,
naming the key, the backend and the feature; a run that asks for none passes everywhere."""

import pytest

from loong_models import ModelConfig
from loong_parallel import ParallelConfig, require_features
from loong_parallel.capabilities import FEATURE_KEYS
from loong_xpu import FEATURES, UnsupportedFeatureError, get_accelerator
from loong_xpu.backends.cuda import CudaAccelerator

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
