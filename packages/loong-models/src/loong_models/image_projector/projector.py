"""The image projector: encoder patch features -> foundation-sized tokens, on megatron's MLP
(column- then row-parallel linears from specs.py)."""

from __future__ import annotations

import torch
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from loong_models.image_encoder.vit import ACTIVATIONS, runtime_fields
from loong_models.image_projector.config import ImageProjectorConfig
from loong_models.norm import RMSNorm
from loong_models.specs import projector_mlp_spec


def build_projector_transformer_config(
    cfg: ImageProjectorConfig,
    base: TransformerConfig,
    *,
    encoder_hidden: int,
    merge: int,
    out_size: int,
    tensor_model_parallel_size: int,
    backend: str,
) -> TransformerConfig:
    """megatron's MLP reads its sizes from a TransformerConfig: hidden = the foundation's (output),
    ffn = the projector's."""
    fields = dict(
        num_layers=1,
        hidden_size=out_size,
        ffn_hidden_size=cfg.ffn_size(encoder_hidden, merge),
        num_attention_heads=tensor_model_parallel_size,  # unused by the MLP; megatron checks divisibility
        gated_linear_unit=False,
        activation_func=ACTIVATIONS[cfg.activation],
        add_bias_linear=cfg.bias,
        init_method_std=cfg.init_method_std,
        hidden_dropout=0.0,
    )
    fields.update(
        runtime_fields(base, tensor_model_parallel_size=tensor_model_parallel_size, backend=backend)
    )
    fields["bias_activation_fusion"] = False  # megatron's fused bias-GELU is the tanh approximation
    return TransformerConfig(**fields)


class ImageProjector(MegatronModule):
    """``forward(x [N, encoder_hidden]) -> [N / merge**2, out_size]``; modules ``norm`` (optional)
    and ``mlp.linear_fc1`` / ``mlp.linear_fc2``."""

    def __init__(
        self,
        cfg: ImageProjectorConfig,
        config: TransformerConfig,
        *,
        encoder_hidden: int,
        merge: int,
        layer_backend: str,
        tp_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        super().__init__(config=config)
        self.merge_unit = merge * merge
        if cfg.norm == "RMSNorm":
            self.norm = RMSNorm(config, encoder_hidden, eps=cfg.norm_epsilon)
        elif cfg.norm == "LayerNorm":
            self.norm = torch.nn.LayerNorm(encoder_hidden, eps=cfg.norm_epsilon, dtype=config.params_dtype)
        else:
            self.norm = None
        self.mlp = MLP(config, projector_mlp_spec(layer_backend), input_size=cfg.input_size(encoder_hidden, merge),
            ffn_hidden_size=config.ffn_hidden_size,
                       tp_group=tp_group)  # fmt: skip

    def set_input_tensor(self, input_tensor) -> None:  # the projector never sits on a later PP stage
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % self.merge_unit:
            raise ValueError(
                f"{x.shape[0]} patches do not split into groups of {self.merge_unit} (merge_size**2)"
            )
        if self.norm is not None:
            x = self.norm(x)
        # megatron's linears expect [s, b, h]
        out, bias = self.mlp(x.reshape(-1, 1, self.merge_unit * x.shape[-1]))
        out = out if bias is None else out + bias
        return out[:, 0]
