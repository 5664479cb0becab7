"""``model.lora.init_from``: LoRA training continues from a PEFT adapter directory."""

from __future__ import annotations

import torch

from loong_train.schema import ConfigError


def load_adapters(path: str, chunks: list[torch.nn.Module], model_cfg) -> None:
    """Set the model's adapters from the PEFT adapter at ``path``; its problems name the key."""
    from loong_ckpt.hf_config import ConversionError
    from loong_ckpt.peft_import import load_peft_adapters

    try:
        load_peft_adapters(path, chunks, model_cfg)
    except ConversionError as e:
        raise ConfigError(str(e)) from None
