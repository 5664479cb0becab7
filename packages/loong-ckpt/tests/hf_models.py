"""Tiny random HF models (built from transformers config classes, saved with save_pretrained)."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
}


def make_hf_model(path: Path, family: str, *, tie: bool = False, vocab: int = 1000, layers: int = 2,
                  seed: int = 0, max_shard_size: str | None = None) -> Path:
    import transformers

    cls_name, extra = FAMILY_CONFIGS[family]
    config = getattr(transformers, cls_name)(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=vocab, max_position_embeddings=256,
        tie_word_embeddings=tie, rms_norm_eps=1e-6, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms and biases too, so that a swapped tensor cannot go unnoticed
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits
