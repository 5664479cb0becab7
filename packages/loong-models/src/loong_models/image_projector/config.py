"""The image projector component's config: an MLP from the encoder's patch features to the
foundation's hidden size, merging ``spatial_merge_size**2`` neighbouring patches into one token."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from loong_models.choices import Activation, Norm, Recompute


class ProjectorType(StrEnum):
    mlp = "mlp"  # norm -> merge -> fc1 -> activation -> fc2 (Qwen2.5-VL's patch merger)


@dataclass
class ImageProjectorConfig:
    """``norm`` (per patch, before merging) -> concat ``merge**2`` patches -> ``linear_fc1`` ->
    activation -> ``linear_fc2`` (to the foundation's hidden size).

    Qwen2.5-VL's patch merger is this projector (RMSNorm, GELU, ffn = encoder hidden * 4), so the
    encoder stays a plain ViT and the HF ``visual.merger.*`` weights map here. The merge size is
    the encoder's ``spatial_merge_size`` (one source of truth for the token count per image).
    """

    type: ProjectorType = ProjectorType.mlp
    norm: Norm | None = Norm.RMSNorm
    norm_epsilon: float = 1e-6
    ffn_hidden_size: int | None = None  # null = encoder hidden * merge**2 (Qwen2.5-VL)
    activation: Activation = Activation.gelu
    bias: bool = True
    init_method_std: float = 0.02
    # Runs on the encoder's tensor-parallel group: null or the encoder's size.
    tensor_model_parallel_size: int | None = None
    freeze: bool = False
    recompute: Recompute | None = None  # accepted for symmetry; the projector is two linears, nothing to recompute

    def input_size(self, encoder_hidden: int, merge: int) -> int:
        return encoder_hidden * merge * merge

    def ffn_size(self, encoder_hidden: int, merge: int) -> int:
        return self.ffn_hidden_size or self.input_size(encoder_hidden, merge)

    def num_parameters(self, encoder_hidden: int, merge: int, out_size: int, num_deepstack: int = 0) -> int:
        """Exact count; ``num_deepstack`` DeepStack mergers (norm over the merged width) included."""
        i, f = self.input_size(encoder_hidden, merge), self.ffn_size(encoder_hidden, merge)
        per = {None: 0, "RMSNorm": 1, "LayerNorm": 2}[self.norm]
        mlp = i * f + f * out_size + ((f + out_size) if self.bias else 0)
        return per * encoder_hidden + mlp + num_deepstack * (per * i + mlp)
