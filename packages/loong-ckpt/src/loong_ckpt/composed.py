"""Declarations of composed models (an image encoder + image projector + foundation LLM, ...): a
:class:`ModelMapping` lists one HF architecture's components, each a :class:`ComponentMapping`
(the component's rules and prefixes). Declared as data in :mod:`loong_ckpt.vlm`; bound and used
by :mod:`loong_ckpt.components`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loong_ckpt.hf_config import ConversionError
from loong_ckpt.mapping import Rule

# An HF naming of a composed model: per component, (old prefix, new prefix) replacements applied
# to its rules' HF names (the first matching one wins; "" matches every name).
Renames = tuple[tuple[str, str], ...]



@dataclass(frozen=True)
class ComponentMapping:
    """One component of a composed model: its rules and where its keys live on each side."""

    component: str  # the ModelConfig field holding its config (image_encoder, image_projector, foundation)
    mcore_prefix: str  # prefix of its keys in the composed model's sharded_state_dict
    # naming -> HF renames for its rules' names (see Renames); every naming of the ModelMapping
    hf_renames: dict[str, Renames]
    # The rules for the model config (the foundation's come from its family, so they are looked up).
    rules: Callable[[Any], Sequence[Rule]]
    # What the rules' transforms read: the component's head geometry (FoundationConfig for the LLM).
    shapes: Callable[[Any], Any]


@dataclass(frozen=True)
class ModelMapping:
    """A composed HF architecture: its components, its HF namings and its config.json mapping."""

    name: str
    hf_architectures: tuple[str, ...]
    encoder_type: str  # the ModelConfig's image_encoder.type this mapping converts
    components: tuple[ComponentMapping, ...]
    # HF namings this architecture's checkpoints use, the first being what save_pretrained writes,
    # each recognised by a tensor only that naming has.
    namings: dict[str, str]
    from_hf: Callable[[dict[str, Any], str], Any]  # config.json -> ModelConfig (raises ConversionError)
    to_hf: Callable[[Any, torch.dtype], dict[str, Any]]  # ModelConfig -> config.json
    same_architecture: Callable[[Any, Any], bool]

    def naming_of(self, tensor_names: Sequence[str] | set[str], source: str) -> str:
        names = set(tensor_names)
        for naming, marker in self.namings.items():
            if marker in names:
                return naming
        raise ConversionError(
            f"{source}: no tensor names the {self.name} layout; expected one of "
            f"{', '.join(self.namings.values())}"
        )
