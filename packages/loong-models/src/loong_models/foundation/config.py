"""The foundation (LLM) component's config: the schema its YAML files fill."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum

from loong_models.choices import OutputLoss, Recompute
from loong_models.foundation.families import FAMILIES, Family, FamilyName, get_family
from loong_models.foundation.mla import MLAConfig, SparseAttentionConfig
from loong_models.foundation.moe import MoEConfig
from loong_models.precision.config import PrecisionConfig


class RecomputeModule(StrEnum):
    """megatron-core's recompute_modules choices (selective recompute) that Loong's models contain."""

    core_attn = "core_attn"
    moe_act = "moe_act"
    layernorm = "layernorm"
    mla_up_proj = "mla_up_proj"
    mlp = "mlp"
    moe = "moe"
    shared_experts = "shared_experts"


class RopeType(StrEnum):
    llama3 = "llama3"  # GQA families (megatron's RotaryEmbedding)
    yarn = "yarn"  # MLA families (megatron's YaRN rotary embedding)


# megatron-core implements exactly the Llama-3 RoPE scaling of HF's "llama3" rope_type with these
# constants (RotaryEmbedding._apply_scaling); other values would silently be ignored.
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass
class RopeScaling:
    """llama3 (GQA families) or yarn (MLA families: DeepSeek-V3's long-context RoPE, with its
    softmax-scale correction ``mscale_all_dim``); ``ROPE_TYPE_FIELDS`` names each type's keys."""

    type: RopeType = RopeType.llama3
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


ROPE_TYPE_FIELDS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
}


@dataclass
class FoundationConfig:
    """A decoder-only LLM. Field names follow megatron-core where one exists."""

    family: FamilyName = FamilyName.llama
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # GQA groups (KV heads); None = MHA
    kv_channels: int | None = None  # head dim; None = hidden_size / num_attention_heads
    vocab_size: int = 8192
    max_position_embeddings: int = 2048
    rotary_base: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Multimodal RoPE (Qwen2-VL / 2.5-VL): rotary frequency pairs given to the temporal, height
    # and width positions, e.g. [16, 24, 24] for head dim 128; null = plain 1-D RoPE.
    mrope_section: list[int] | None = None
    # Interleaved multimodal RoPE (Qwen3-VL): frequencies take t, h, w in turn instead of blocks.
    mrope_interleaved: bool = False
    # Multi-latent attention sizes (families with attention="mla"); replaces the GQA head sizes.
    mla: MLAConfig | None = None
    # DeepSeek sparse attention (families with sparse_attention=True); needs `mla`.
    sparse_attention: SparseAttentionConfig | None = None
    # Mixture-of-Experts MLP (families with moe="required"/"optional"); None = dense MLP everywhere.
    moe: MoEConfig | None = None
    norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    init_method_std: float = 0.02
    # Std of the word embeddings at random init; None = init_method_std. Large MoE models set 1.0:
    # at 0.02 the first attention's output (under near-uniform causal attention, a running mean of
    # the prefix's values, nearly the same vector for neighbouring tokens) outweighs each token's
    # embedding, so every router sees almost the same input and sends all tokens to the same top-k
    # experts (load imbalance 14.6 of at most 16 at qwen3-30b-a3b's shape). Untied embeddings only:
    # a tied output layer would turn a std of 1.0 into logits of std sqrt(hidden).
    embedding_init_std: float | None = None
    # Pad the embedding table to a multiple of this (kernel-friendly shapes). Kept independent of
    # the tensor-parallel size so that checkpoints keep one shape for every TP layout.
    make_vocab_size_divisible_by: int = 128
    # Component-level overrides of the global settings (principle 4 of DESIGN.md).
    tensor_model_parallel_size: int | None = None
    freeze: bool = False
    recompute: Recompute | None = None
    # With recompute=selective: which submodules to recompute (megatron's recompute_modules);
    # None = megatron's default (core_attn).
    recompute_modules: list[RecomputeModule] | None = None
    # Multi-token prediction (DeepSeek-V3): this many extra layers after the decoder, the k-th
    # predicting token t+1+k from the decoder's state and token t+k's embedding (megatron's MTP
    # block: enorm, hnorm, eh_proj, one transformer layer like the decoder's last, a final norm;
    # embedding and output head shared). None = no MTP.
    mtp_num_layers: int | None = None
    # The MTP losses' weight (their mean over the layers) added to the LM loss.
    mtp_loss_scaling_factor: float = 0.1
    # The LM loss of the output layer: megatron (logits, then megatron's fused vocab-parallel
    # cross-entropy) or fused (loong_kernels' linear + cross-entropy per token chunk: no full
    # logits; TP = PP = CP = 1, no sequence parallelism, no MTP). See foundation/output_loss.py.
    output_loss: OutputLoss = OutputLoss.megatron
    # output_loss=fused: tokens per chunk of logits; null = the kernel's default (512 MiB of bf16
    # logits, 1 GiB with the FP8 output layer). Larger chunks cost memory and save passes over dW
    # (each chunk reads and writes the whole weight gradient once).
    output_loss_chunk_tokens: int | None = None
    # FP8 of the TE linears: off | on | adaptive (per GEMM kind, from a measured policy file)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    extra: dict = field(default_factory=dict)  # family-specific knobs, passed to TransformerConfig

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    def padded_vocab_size(self, tensor_parallel_size: int = 1) -> int:
        multiple = math.lcm(self.make_vocab_size_divisible_by, tensor_parallel_size)
        return math.ceil(self.vocab_size / multiple) * multiple

    def validate(self, prefix: str = "model.foundation") -> None:
        """Raise ValueError naming the offending key for inconsistent sizes."""
        self._validate_attention(get_family(self.family), prefix)
        if self.mla is None and self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{prefix}.hidden_size={self.hidden_size} is not divisible by "
                f"{prefix}.num_attention_heads={self.num_attention_heads}; set {prefix}.kv_channels"
            )
        if self.num_attention_heads % self.query_groups:
            raise ValueError(
                f"{prefix}.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"{prefix}.num_query_groups={self.query_groups}"
            )
        if self.mrope_interleaved and self.mrope_section is None:
            raise ValueError(f"{prefix}.mrope_interleaved=true needs {prefix}.mrope_section")
        if self.mrope_section is not None:
            if self.mla is not None or self.rope_scaling is not None:
                raise ValueError(f"{prefix}.mrope_section cannot be combined with MLA or rope_scaling")
            if len(self.mrope_section) != 3 or 2 * sum(self.mrope_section) != self.head_dim:
                raise ValueError(
                    f"{prefix}.mrope_section={list(self.mrope_section)} must be 3 numbers summing to "
                    f"head_dim / 2 = {self.head_dim // 2}"
                )
        self._validate_recompute_modules(prefix)
        self._validate_moe(get_family(self.family), prefix)
        if self.mtp_num_layers is not None and self.mtp_num_layers < 1:
            raise ValueError(f"{prefix}.mtp_num_layers={self.mtp_num_layers}; expected null (no MTP) or >= 1")
        if self.output_loss == OutputLoss.fused and self.mtp_num_layers:
            raise ValueError(f"{prefix}.output_loss=fused cannot run with {prefix}.mtp_num_layers={self.mtp_num_layers} "
                             "(megatron's MTP loss reads the output layer's logits); use output_loss=megatron")  # fmt: skip
        if self.output_loss_chunk_tokens is not None:
            if self.output_loss != OutputLoss.fused:
                raise ValueError(f"{prefix}.output_loss_chunk_tokens is only read with {prefix}.output_loss=fused")
            if self.output_loss_chunk_tokens < 16 or self.output_loss_chunk_tokens % 16:
                raise ValueError(f"{prefix}.output_loss_chunk_tokens={self.output_loss_chunk_tokens}: expected a "
                                 "multiple of 16 (the FP8 GEMMs' granularity), or null for the default")  # fmt: skip
        if self.mtp_loss_scaling_factor < 0:
            raise ValueError(f"{prefix}.mtp_loss_scaling_factor={self.mtp_loss_scaling_factor}; expected >= 0")
        if self.embedding_init_std is not None:
            self._validate_embedding_init(prefix)
        if self.rope_scaling is not None:
            self._validate_rope_scaling(prefix)
        self.precision.validate(f"{prefix}.precision")
        if self.precision.fp8_output_layer and self.output_loss != OutputLoss.fused:
            raise ValueError(f"{prefix}.precision.fp8_output_layer=true needs {prefix}.output_loss=fused "
                             "(the FP8 output layer is the fused loss's FP8 GEMMs)")  # fmt: skip

    def gemm_kinds(self) -> list[str]:
        """The GEMM kinds of this model's layers (loong_models.precision.GEMM_KINDS' names)."""
        if self.mla is None:
            attn = ["qkv", "proj"]
        else:
            attn = ["q_down_proj", "q_up_proj"] if self.mla.q_lora_rank else ["q_proj"]
            attn += ["kv_down_proj", "kv_up_proj", "proj"]
        moe, dense = self.moe, ["fc1", "fc2"]
        if moe is None:
            return attn + dense
        mlp = dense if moe.moe_layers(self.num_layers) < self.num_layers else []
        mlp += ["expert_fc1", "expert_fc2"]
        return attn + mlp + (["shared_fc1", "shared_fc2"] if moe.shared_expert_intermediate_size else [])

    def _validate_rope_scaling(self, prefix: str) -> None:
        rs = self.rope_scaling
        wanted = RopeType.yarn if self.mla is not None else RopeType.llama3  # megatron: YaRN in MLA, llama3 in RoPE
        if rs.type != wanted:
            raise ValueError(f"{prefix}.rope_scaling.type={str(rs.type)!r}; allowed for this attention: {wanted}")
        if self.sparse_attention is not None:  # Loong's DSA attention applies plain RoPE (attention/)
            raise ValueError(f"{prefix}.rope_scaling with sparse_attention (DSA) is not supported yet; set it to null")
        if rs.type == "llama3":
            for key, expected in _MEGATRON_LLAMA3_ROPE.items():
                if getattr(rs, key) != expected:
                    raise ValueError(
                        f"{prefix}.rope_scaling.{key}={getattr(rs, key)}: megatron-core implements "
                        f"Llama-3 scaling with {key}={expected} only"
                    )

    def _validate_embedding_init(self, prefix: str) -> None:
        std = self.embedding_init_std
        if std <= 0:
            raise ValueError(f"{prefix}.embedding_init_std={std}; expected > 0 or null (= init_method_std)")
        if self.tie_word_embeddings and std > 0.1:
            raise ValueError(
                f"{prefix}.embedding_init_std={std} with tie_word_embeddings=true: the tied output layer "
                f"would start with logits of std {std} * sqrt(hidden_size); expected <= 0.1 or untied"
            )

    def _validate_recompute_modules(self, prefix: str) -> None:
        if self.recompute_modules is None:
            return
        if self.recompute != "selective":
            raise ValueError(
                f"{prefix}.recompute_modules=[{', '.join(self.recompute_modules)}] needs "
                f"{prefix}.recompute=selective (got {self.recompute and str(self.recompute)})"
            )
        needs = {"mla_up_proj": ("mla", "an MLA family"), "moe": ("moe", "a moe: config"),
                 "moe_act": ("moe", "a moe: config")}  # fmt: skip
        for m, (key, what) in needs.items():
            if m in self.recompute_modules and getattr(self, key) is None:
                raise ValueError(f"{prefix}.recompute_modules: {str(m)!r} needs {what}")
        shared = self.moe is not None and self.moe.shared_expert_intermediate_size
        if "shared_experts" in self.recompute_modules and not shared:
            raise ValueError(
                f"{prefix}.recompute_modules: 'shared_experts' needs {prefix}.moe.shared_expert_intermediate_size"
            )

    def _validate_moe(self, fam: Family, prefix: str) -> None:
        if fam.moe == "required" and self.moe is None:
            raise ValueError(f"{prefix}.moe is required by family {fam.name!r}")
        if fam.moe == "never" and self.moe is not None:
            users = [f.name for f in FAMILIES.values() if f.moe != "never"]
            raise ValueError(
                f"{prefix}.moe is set but family {fam.name!r} has a dense MLP; families with MoE: {', '.join(users)}"
            )
        if self.moe is not None:
            self.moe.validate(f"{prefix}.moe", self.num_layers)

    def _validate_attention(self, fam: Family, prefix: str) -> None:
        """The sub-configs a family's attention needs are present, and only those."""
        users = {"mla": [f.name for f in FAMILIES.values() if f.attention == "mla"],
                 "sparse_attention": [f.name for f in FAMILIES.values() if f.sparse_attention]}  # fmt: skip
        for key, needed in (("mla", fam.attention == "mla"), ("sparse_attention", fam.sparse_attention)):
            value = getattr(self, key)
            if needed and value is None:
                raise ValueError(f"{prefix}.{key} is required by family {fam.name!r}")
            if not needed and value is not None:
                raise ValueError(
                    f"{prefix}.{key} is set but family {fam.name!r} does not use it; "
                    f"families that do: {', '.join(users[key])}"
                )
        if self.mla is None:
            return
        self.mla.validate(f"{prefix}.mla")
        # MLA fixes its own head sizes; GQA keys would be silently ignored, so reject them.
        for key in ("num_query_groups", "kv_channels"):  # (MLA takes rope_scaling: YaRN)
            if getattr(self, key) is not None:
                raise ValueError(
                    f"{prefix}.{key} does not apply to family {fam.name!r} (MLA); set it to null"
                )
        if self.sparse_attention is not None:
            self.sparse_attention.validate(f"{prefix}.sparse_attention", self.mla)
            if self.mla.q_lora_rank is None:
                raise ValueError(
                    f"{prefix}.mla.q_lora_rank must be set with sparse_attention: the indexer reads the query latent"
                )

    def _attention_parameters(self) -> int:
        """One layer's attention block (projections, biases, q/k norms, DSA indexer)."""
        h, d = self.hidden_size, self.head_dim
        if self.mla is not None:
            n = self.mla.num_parameters(h, self.num_attention_heads)
            if self.sparse_attention is not None:
                n += self.sparse_attention.num_parameters(h, self.mla)
            return n
        fam = get_family(self.family)
        q, kv = self.num_attention_heads * d, self.query_groups * d
        return h * (q + 2 * kv) + q * h + (q + 2 * kv if fam.qkv_bias else 0) + (2 * d if fam.qk_norm else 0)

    def num_parameters(self, include_embedding: bool = True, *, active: bool = False) -> int:
        """Exact parameter count of the model this config builds (unpadded vocab), as the released
        checkpoint counts it: MoE routers' expert bias included (megatron keeps it as a buffer).

        ``active``: the parameters one token uses (``router_topk`` routed experts of each MoE
        layer, all else), the N of the MFU formula for MoE models."""
        h, f = self.hidden_size, self.ffn_hidden_size
        attn = self._attention_parameters()
        dense_mlp = 3 * h * f
        dense_layers, moe_layers = self.num_layers, 0
        moe_mlp = 0
        if self.moe is not None:
            moe_layers = self.moe.moe_layers(self.num_layers)
            dense_layers -= moe_layers
            moe_mlp = self.moe.num_parameters(h, active=active)
        per_layer = attn + 2 * h  # attention + the two norms
        total = (
            self.num_layers * per_layer + dense_layers * dense_mlp + moe_layers * moe_mlp + h
        )  # + final norm
        if self.mtp_num_layers:  # each: a copy of the last layer + enorm, hnorm, eh_proj, final norm
            last_moe = self.moe is not None and self.moe.layer_pattern(self.num_layers)[-1] == 1
            mtp_layer = per_layer + (moe_mlp if last_moe else dense_mlp) + 3 * h + 2 * h * h
            total += self.mtp_num_layers * mtp_layer
        if include_embedding:
            total += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total

    def num_active_parameters(self, include_embedding: bool = True) -> int:
        """Parameters used per token (equals :meth:`num_parameters` for a dense model)."""
        return self.num_parameters(include_embedding, active=True)

    def training_flops(self, tokens: int, token_pairs: int) -> float:
        """Training FLOPs (DESIGN.md) of ``tokens`` tokens: 6 N per token for the weights it uses
        (active parameters of an MoE) + 6 L h per (token, token of its sample) pair of causal
        attention, ``token_pairs`` = sum over the samples of length**2."""
        return float(6 * self.num_active_parameters() * tokens + 6 * self.num_layers * self.hidden_size * token_pairs)

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token of ``seq_length``-token rows: 6 N + 6 L h s."""
        return self.training_flops(1, seq_length)
