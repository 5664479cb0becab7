"""Which config keys ask for which optional accelerator feature (loong_xpu.FEATURES). A key that
asks for a feature the accelerator lacks is refused before anything is built, naming both."""

from __future__ import annotations

from collections.abc import Callable

from loong_train.schema import Config, ConfigError
from loong_xpu import Accelerator, UnsupportedFeatureError

# (config key, does this config ask for it, the feature it needs)
FEATURE_KEYS: tuple[tuple[str, Callable[[Config], bool], str], ...] = (
    ("model.layer_backend=te", lambda c: c.model.layer_backend == "te", "te"),
    ("parallel.moe_a2a_overlap=true", lambda c: c.parallel.moe_a2a_overlap, "side_streams"),
    ("parallel.moe_shared_expert_overlap=true", lambda c: c.parallel.moe_shared_expert_overlap, "side_streams"),
    ("parallel.offload_activations", lambda c: bool(c.parallel.offload_activations), "side_streams"),
)


def check_features(cfg: Config, accel: Accelerator) -> None:
    """Raise ConfigError for the first key whose feature ``accel`` does not have."""
    for key, asks, feature in FEATURE_KEYS:
        if asks(cfg):
            try:
                accel.require(feature, key)
            except UnsupportedFeatureError as e:
                raise ConfigError(str(e)) from None
