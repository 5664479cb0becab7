"""Tiny random HF models (built from transformers config classes, saved with save_pretrained)."""

from __future__ import annotations

from pathlib import Path

import torch

_UNSET = object()  # a base kwarg this family's config does not take
_MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2, norm_topk_prob=True)
FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    # 4 experts (2 per rank at EP=2), all layers MoE
    "qwen3-moe": ("Qwen3MoeConfig", dict(_MOE, num_experts=4)),
    # MLA with a query latent; a dense first layer, then MoE with a shared expert and sigmoid
    # group-limited routing (2 groups, best 1: megatron and HF rank groups alike when topk/topk_group=2)
    "deepseek-v3": ("DeepseekV3Config", dict(
        _MOE, num_key_value_heads=4, head_dim=_UNSET, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0,
    )),
}  # fmt: skip


def make_hf_model(
    path: Path,
    family: str,
    *,
    tie: bool = False,
    vocab: int = 1000,
    layers: int = 2,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: object,
) -> Path:
    import transformers

    cls_name, extra = FAMILY_CONFIGS[family]
    kwargs = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=vocab, max_position_embeddings=256,
        tie_word_embeddings=tie, rms_norm_eps=1e-6,
    )  # fmt: skip
    kwargs.update(extra)
    kwargs.update(overrides)  # per-test variants of the family's config
    config = getattr(transformers, cls_name)(**{k: v for k, v in kwargs.items() if v is not _UNSET})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms and biases too, so that a swapped tensor cannot go unnoticed
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(("bias", "e_score_correction_bias")):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):  # routers: well-separated scores, no near-ties in top-k
                p.normal_(0.0, 0.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits
