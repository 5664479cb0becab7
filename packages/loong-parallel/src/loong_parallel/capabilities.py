"""Which config keys of a run ask for which optional accelerator feature (loong_xpu.FEATURES): the
layout's overlaps and offloading need side streams, the model's TE layers need TE. A key that asks
for a feature the accelerator lacks is refused before anything is built, naming both."""

from __future__ import annotations

from collections.abc import Callable

from loong_models import ModelConfig
from loong_parallel.config import ParallelConfig
from loong_xpu import Accelerator

# (config key, does this run ask for it, the feature it needs)
FEATURE_KEYS: tuple[tuple[str, Callable[[ModelConfig, ParallelConfig], bool], str], ...] = (
    ("model.layer_backend=te", lambda m, p: m.layer_backend == "te", "te"),
    ("parallel.moe_a2a_overlap=true", lambda m, p: p.moe_a2a_overlap, "side_streams"),
    ("parallel.moe_shared_expert_overlap=true", lambda m, p: p.moe_shared_expert_overlap, "side_streams"),
    ("parallel.offload_activations", lambda m, p: bool(p.offload_activations), "side_streams"),
)


def require_features(model: ModelConfig, parallel: ParallelConfig, accel: Accelerator) -> None:
    """Raise :class:`loong_xpu.UnsupportedFeatureError` (a ValueError) for the first key whose
    feature ``accel`` does not have."""
    for key, asks, feature in FEATURE_KEYS:
        if asks(model, parallel):
            accel.require(feature, key)
