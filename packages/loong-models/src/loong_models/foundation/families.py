"""LLM families: what distinguishes Llama from Qwen2 from Qwen3 at the architecture level.

A family is a declaration, not code: adding one means adding an entry to :data:`FAMILIES`.
Sizes (layers, hidden, heads ...) come from the zoo YAMLs; these are the switches a family fixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class Family:
    name: str
    qkv_bias: bool = False  # bias on the Q, K, V projections (Qwen2/2.5)
    qk_norm: bool = False  # RMSNorm on each head's queries and keys (Qwen3)
    # "gqa": megatron's SelfAttention (MHA/GQA, head sizes from the YAML); "mla": multi-latent
    # attention, sizes from the YAML's `mla:` sub-config (DeepSeek-V2/V3/V3.2)
    attention: str = "gqa"
    sparse_attention: bool = False  # DeepSeek sparse attention on MLA, sizes from `sparse_attention:`
    # Mixture-of-Experts MLP, sizes from the YAML's `moe:` sub-config: "required", "optional"
    # (DeepSeek-V3.2: MoE at full size, a dense MLP in the tiny test model) or "never".
    moe: str = "never"
    hf_architectures: tuple[str, ...] = ()  # HF `architectures` entries this family reads/writes
    hf_model_type: str = ""


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", hf_architectures=("LlamaForCausalLM",), hf_model_type="llama"),
        Family("qwen2", qkv_bias=True, hf_architectures=("Qwen2ForCausalLM",), hf_model_type="qwen2"),
        Family("qwen3", qk_norm=True, hf_architectures=("Qwen3ForCausalLM",), hf_model_type="qwen3"),
        Family(
            "qwen3-moe",
            qk_norm=True,
            moe="required",
            hf_architectures=("Qwen3MoeForCausalLM",),
            hf_model_type="qwen3_moe",
        ),
        Family(
            "deepseek-v3",
            attention="mla",
            moe="required",
            hf_architectures=("DeepseekV3ForCausalLM",),
            hf_model_type="deepseek_v3",
        ),
        Family(
            "deepseek-v32",
            attention="mla",
            sparse_attention=True,
            moe="optional",
            hf_architectures=("DeepseekV32ForCausalLM",),
            hf_model_type="deepseek_v32",
        ),
    )
}


# The names of FAMILIES, the type of FoundationConfig.family (OmegaConf names the allowed ones).
FamilyName = StrEnum("FamilyName", {name: name for name in FAMILIES}, module=__name__)


def get_family(name: str) -> Family:
    return FAMILIES[name]
