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


class MegatronModuleList(torch.nn.ModuleList):
    """A ModuleList of MegatronModules whose checkpoint keys keep each member's own sharding
    (megatron treats a plain ModuleList's tensors as replicated over TP)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return {k: v for j, m in enumerate(self) for k, v in m.sharded_state_dict(f"{prefix}{j}.", sharded_offsets,
                                                                                  metadata).items()}  # fmt: skip


class ImageProjector(MegatronModule):
    """``forward(x [N, encoder_hidden]) -> [N / merge**2, out_size]``; modules ``norm`` (optional)
    and ``mlp.linear_fc1`` / ``mlp.linear_fc2``.

    With ``num_deepstack`` > 0 (Qwen3-VL's DeepStack) it also holds ``deepstack.<j>``: one more
    merger per DeepStack encoder layer, the same MLP with its norm over the merged
    ``merge**2 * encoder_hidden`` features (HF's ``use_postshuffle_norm``); :meth:`project_deepstack`
    runs them."""

    def __init__(
        self,
        cfg: ImageProjectorConfig,
        config: TransformerConfig,
        *,
        encoder_hidden: int,
        merge: int,
        layer_backend: str,
        tp_group: torch.distributed.ProcessGroup | None = None,
        num_deepstack: int = 0,
        postshuffle_norm: bool = False,
    ) -> None:
        super().__init__(config=config)
        self.merge_unit = merge * merge
        self.postshuffle_norm = postshuffle_norm
        width = encoder_hidden * self.merge_unit if postshuffle_norm else encoder_hidden
        if cfg.norm == "RMSNorm":
            self.norm = RMSNorm(config, width, eps=cfg.norm_epsilon)
        elif cfg.norm == "LayerNorm":
            self.norm = torch.nn.LayerNorm(width, eps=cfg.norm_epsilon, dtype=config.params_dtype)
        else:
            self.norm = None
        self.mlp = MLP(config, projector_mlp_spec(layer_backend), input_size=cfg.input_size(encoder_hidden, merge),
                       ffn_hidden_size=config.ffn_hidden_size, tp_group=tp_group)  # fmt: skip
        if num_deepstack:
            self.deepstack = MegatronModuleList(
                ImageProjector(cfg, config, encoder_hidden=encoder_hidden, merge=merge, layer_backend=layer_backend,
                               tp_group=tp_group, postshuffle_norm=True)  # fmt: skip
                for _ in range(num_deepstack)
            )

    def set_input_tensor(self, input_tensor) -> None:  # the projector never sits on a later PP stage
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % self.merge_unit:
            raise ValueError(
                f"{x.shape[0]} patches do not split into groups of {self.merge_unit} (merge_size**2)"
            )
        merged = x.shape[-1] * self.merge_unit
        if self.norm is not None:
            x = self.norm(x.reshape(-1, merged)) if self.postshuffle_norm else self.norm(x)
        # megatron's linears expect [s, b, h]
        out, bias = self.mlp(x.reshape(-1, 1, merged))
        out = out if bias is None else out + bias
        return out[:, 0]

    def project_deepstack(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """The DeepStack encoder layers' features, each through its own merger."""
        mergers = getattr(self, "deepstack", ())
        if len(features) != len(mergers):
            raise ValueError(f"{len(features)} DeepStack feature maps for {len(mergers)} DeepStack mergers "
                             "(model.image_encoder.deepstack_visual_indexes)")  # fmt: skip
        return [m(f) for m, f in zip(mergers, features)]
