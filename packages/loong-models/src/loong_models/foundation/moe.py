"""Mixture-of-Experts sub-config of the foundation schema (Qwen3-MoE, DeepSeek-V3), with its
validation and exact parameter counts.

The fields map one to one onto megatron-core's ``moe_*`` TransformerConfig fields (build.py);
where the name differs, the comment names megatron's field. How experts are laid out over devices
(expert parallelism, token dispatcher, overlap, offload) is the parallel config's business.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class ScoreFunction(StrEnum):
    softmax = "softmax"  # Qwen3-MoE
    sigmoid = "sigmoid"  # DeepSeek-V3


class LoadBalancing(StrEnum):
    """megatron's moe_router_load_balancing_type values."""

    aux_loss = "aux_loss"
    seq_aux_loss = "seq_aux_loss"
    global_aux_loss = "global_aux_loss"
    # no balancing loss (with expert_bias=true: DeepSeek-V3's aux-loss-free balancing through the
    # expert bias alone)
    none = "none"


class TokenDropPolicy(StrEnum):
    probs = "probs"  # drop the tokens of lowest router probability first
    position = "position"  # drop the last tokens first


class RouterDType(StrEnum):
    fp32 = "fp32"
    fp64 = "fp64"


@dataclass
class MoEConfig:
    """Routed experts (plus optional shared experts) replacing the dense MLP of MoE layers."""

    num_experts: int = 8  # megatron: num_moe_experts
    router_topk: int = 2  # experts per token
    ffn_hidden_size: int = 256  # one routed expert's intermediate size (megatron: moe_ffn_hidden_size)
    # Total intermediate size of the shared experts (n_shared x their size); None = no shared expert.
    shared_expert_intermediate_size: int | None = None
    # The first k layers keep a dense MLP of FoundationConfig.ffn_hidden_size (DeepSeek-V3: 3).
    first_k_dense: int = 0
    # Router: softmax (Qwen3-MoE) or sigmoid (DeepSeek-V3) scores; top-k probabilities renormalised
    # to sum to 1 (softmax over the top-k logits / sigmoid scores divided by their sum), then scaled.
    score_function: ScoreFunction = ScoreFunction.softmax
    topk_scaling_factor: float | None = None  # DeepSeek-V3's routed_scaling_factor (2.5)
    num_groups: int | None = None  # device-limited routing: experts in groups (DeepSeek-V3: 8) ...
    group_topk: int | None = None  # ... tokens go to experts of the best group_topk groups (4)
    # Aux-loss-free load balancing: a per-expert bias added to the scores for top-k selection only,
    # nudged after every step towards uniform load (megatron: moe_router_enable_expert_bias).
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    load_balancing: LoadBalancing = LoadBalancing.aux_loss  # megatron: moe_router_load_balancing_type
    aux_loss_coeff: float = 0.0  # weight of the load-balancing loss (0 = off)
    z_loss_coeff: float | None = None  # router logit z-loss (None = off)
    # Token dropping: each expert takes at most capacity_factor x its fair share of tokens; None =
    # dropless (every routed token is computed).
    capacity_factor: float | None = None
    pad_to_capacity: bool = False  # pad each expert's input to its capacity (static shapes)
    token_drop_policy: TokenDropPolicy = TokenDropPolicy.probs  # which tokens are dropped first
    router_dtype: RouterDType | None = RouterDType.fp32  # router logits / probabilities computed in this dtype

    def validate(self, prefix: str, num_layers: int) -> None:
        for key in ("num_experts", "router_topk", "ffn_hidden_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{prefix}.{key}={getattr(self, key)} must be >= 1")
        if self.router_topk > self.num_experts:
            raise ValueError(
                f"{prefix}.router_topk={self.router_topk} must be <= {prefix}.num_experts={self.num_experts}"
            )
        if self.shared_expert_intermediate_size is not None and self.shared_expert_intermediate_size < 1:
            raise ValueError(
                f"{prefix}.shared_expert_intermediate_size={self.shared_expert_intermediate_size} must be >= 1 or null"
            )
        if not 0 <= self.first_k_dense < num_layers:
            raise ValueError(
                f"{prefix}.first_k_dense={self.first_k_dense} must be in [0, num_layers={num_layers}) "
                "(at least one MoE layer)"
            )
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError(
                f"{prefix}.num_groups and {prefix}.group_topk must be set together (or both null)"
            )
        if self.num_groups is not None:
            assert self.group_topk is not None
            if self.num_groups < 1 or self.num_experts % self.num_groups:
                raise ValueError(
                    f"{prefix}.num_groups={self.num_groups} must divide {prefix}.num_experts={self.num_experts}"
                )
            if not 1 <= self.group_topk <= self.num_groups:
                raise ValueError(
                    f"{prefix}.group_topk={self.group_topk} must be in [1, num_groups={self.num_groups}]"
                )
            if self.router_topk > self.group_topk * (self.num_experts // self.num_groups):
                raise ValueError(
                    f"{prefix}.router_topk={self.router_topk} exceeds the experts of group_topk={self.group_topk} "
                    f"groups ({self.group_topk * (self.num_experts // self.num_groups)})"
                )
        if self.aux_loss_coeff < 0:
            raise ValueError(f"{prefix}.aux_loss_coeff={self.aux_loss_coeff} must be >= 0")
        if self.load_balancing == "none" and self.aux_loss_coeff > 0:
            raise ValueError(
                f"{prefix}.aux_loss_coeff={self.aux_loss_coeff} has no effect with {prefix}.load_balancing='none'; "
                "set it to 0 or pick aux_loss, seq_aux_loss, global_aux_loss"
            )
        if self.z_loss_coeff is not None and self.z_loss_coeff < 0:
            raise ValueError(f"{prefix}.z_loss_coeff={self.z_loss_coeff} must be >= 0 or null")
        if self.bias_update_rate < 0:
            raise ValueError(f"{prefix}.bias_update_rate={self.bias_update_rate} must be >= 0")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(
                f"{prefix}.capacity_factor={self.capacity_factor} must be > 0 or null (dropless)"
            )
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError(
                f"{prefix}.pad_to_capacity=true needs {prefix}.capacity_factor (dropless has no capacity)"
            )

    def moe_layers(self, num_layers: int) -> int:
        return num_layers - self.first_k_dense

    def layer_pattern(self, num_layers: int) -> list[int]:
        """megatron's ``moe_layer_freq`` as a list: 0 = dense MLP, 1 = MoE."""
        return [0] * self.first_k_dense + [1] * self.moe_layers(num_layers)

    def num_parameters(self, hidden_size: int, *, active: bool = False) -> int:
        """One MoE block: router (+ its expert bias, a checkpoint tensor in HF), routed experts
        (all, or the ``router_topk`` a token uses when ``active``) and shared experts (SwiGLU)."""
        h = hidden_size
        experts = self.router_topk if active else self.num_experts
        n = self.num_experts * h + (self.num_experts if self.expert_bias else 0)
        n += experts * 3 * h * self.ffn_hidden_size
        if self.shared_expert_intermediate_size:
            n += 3 * h * self.shared_expert_intermediate_size
        return n
