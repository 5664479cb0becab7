"""Which config keys of a run ask for which optional accelerator feature (loong_xpu.FEATURES): the
layout's overlaps and offloading need side streams, the model's TE layers need TE, FP8 needs FP8
GEMMs of the chosen recipe. A key that asks for a feature the accelerator lacks is refused before
anything is built, naming both."""

from __future__ import annotations

import logging
from collections.abc import Callable

from loong_models import ModelConfig, resolve_backend
from loong_models.precision import check_policy_environment, load_policy
from loong_parallel.config import ParallelConfig
from loong_xpu import Accelerator, UnsupportedFeatureError

logger = logging.getLogger("loong_parallel")

# (config key, does this run ask for it, the feature it needs)
FEATURE_KEYS: tuple[tuple[str, Callable[[ModelConfig, ParallelConfig], bool], str], ...] = (
    ("model.layer_backend=te", lambda m, p: m.layer_backend == "te", "te"),
    ("model.attention_backend", lambda m, p: m.attention_backend != "auto", "te"),
    ("model.grouped_gemm_kernel", lambda m, p: m.grouped_gemm_kernel != "auto", "te"),
    ("parallel.cuda_graphs", lambda m, p: p.cuda_graphs != "none", "cuda_graphs"),
    ("parallel.moe_a2a_overlap=true", lambda m, p: p.moe_a2a_overlap, "side_streams"),
    ("parallel.moe_delay_wgrad=true", lambda m, p: p.moe_delay_wgrad, "te"),
    ("parallel.moe_shared_expert_overlap=true", lambda m, p: p.moe_shared_expert_overlap, "side_streams"),
    ("parallel.offload_activations", lambda m, p: bool(p.offload_activations), "side_streams"),
)

# keys that tune TE layers: refused when model.layer_backend resolves to the local backend
_NEED_TE_LAYERS = ("model.attention_backend", "model.grouped_gemm_kernel", "parallel.cuda_graphs", "parallel.moe_delay_wgrad=true")


def require_features(model: ModelConfig, parallel: ParallelConfig, accel: Accelerator) -> None:
    """Raise :class:`loong_xpu.UnsupportedFeatureError` (a ValueError) for the first key whose
    feature ``accel`` does not have; then check the FP8 settings against the device
    (:func:`require_precision`)."""
    for key, asks, feature in FEATURE_KEYS:
        if asks(model, parallel):
            accel.require(feature, key)
            if key in _NEED_TE_LAYERS:  # the accelerator can run TE; the layers must also resolve to it
                _require_te_layers(model, accel, key)
    require_precision(model, accel)


def _require_te_layers(model: ModelConfig, accel: Accelerator, key: str) -> None:
    if resolve_backend(model.layer_backend, accel.device_type) != "te":
        raise UnsupportedFeatureError(f"{key} needs Transformer Engine layers, but model.layer_backend="
                                      f"{model.layer_backend} resolves to the local backend (install loong-models[te])")  # fmt: skip


def require_precision(model: ModelConfig, accel: Accelerator, prefix: str = "model.foundation.precision") -> None:
    """FP8 needs TE layers, a device that runs the recipe, and for ``adaptive`` a policy measured
    on this GPU for this recipe (another TE version: a warning)."""
    p = model.foundation.precision
    if not p.enabled:
        return
    accel.require("fp8", f"{prefix}.fp8={p.fp8}")
    runs = accel.fp8_recipes()
    if str(p.recipe) not in runs:
        raise UnsupportedFeatureError(f"{prefix}.recipe={p.recipe}: {accel.device_name()!r} cannot run it; "
                                      f"it runs: {', '.join(sorted(runs)) or 'none'}")  # fmt: skip
    _require_te_layers(model, accel, f"{prefix}.fp8={p.fp8}")
    if p.fp8 == "adaptive":
        policy = load_policy(p.policy)
        for warning in check_policy_environment(policy, recipe=p.recipe, gpu_name=accel.device_name(),
                                                te_version=_te_version(), prefix=prefix):  # fmt: skip
            logger.warning(warning)


def _te_version() -> str | None:
    # the installed distribution's version: loong-parallel does not import TE itself
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformer-engine")  # importlib.metadata normalises the name's spelling
    except PackageNotFoundError:
        return None
