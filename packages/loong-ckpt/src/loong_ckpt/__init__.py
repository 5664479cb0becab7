"""loong-ckpt: HF <-> Megatron conversion (offline and online) and training checkpoints.

    from loong_ckpt import hf_to_mcore, mcore_to_hf
    hf_to_mcore("my-hf-model", "ckpt/my-model")        # streaming, bounded memory
    mcore_to_hf("runs/x/checkpoints/step_00000100", "hf-out")

Names are imported on first use, so ``loong-convert`` can quiet megatron's import-time warnings.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ConvertResult": "output", "hf_to_mcore": "convert", "mcore_to_hf": "convert",
    "MAPPINGS": "families", "get_mapping": "families", "supported_architectures": "families",
    "ConversionError": "hf_config", "from_hf_config": "hf_config", "to_hf_config": "hf_config",
    "is_hf_dir": "hf_io",
    "GATE_UP": "mapping", "IDENTITY": "mapping", "QKV": "mapping", "FamilyMapping": "mapping", "Rule": "mapping",
    "Split": "mapping", "Transform": "mapping",
    "export_hf": "online", "load_hf_weights": "online", "read_hf_foundation": "online",
    # composed models (VLMs): component mappings
    "ComponentMapping": "components", "ModelMapping": "components", "MODEL_MAPPINGS": "components",
    "checkpoint_meta": "components", "model_from_hf": "components", "read_hf_model": "online",
    # how a training run starts: init_from / resume / LoRA base
    "Restored": "restore", "RestoreError": "restore", "restore": "restore", "run_meta": "restore",
}  # fmt: skip
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"loong_ckpt.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'loong_ckpt' has no attribute {name!r}")
