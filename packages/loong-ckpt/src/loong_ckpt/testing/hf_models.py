"""Tiny random HF models (built from transformers config classes, saved with save_pretrained)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from loong_data.bundled import VLM_SAMPLE_DIR

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
    # DeepSeek-V3's tiny model plus the lightning indexer: 8 indexer heads (a key scores exactly 0,
    # a possible top-k tie, only when all 8 ReLUs are 0) keeping the best 8 keys, so that every
    # query past position 8 of the parity test's 24 tokens drops keys
    "deepseek-v32": ("DeepseekV32Config", dict(
        _MOE, num_key_value_heads=4, head_dim=_UNSET, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, index_n_heads=8, index_head_dim=16, index_topk=8,
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


def add_mtp_layers(path: Path, n: int = 1, seed: int = 1) -> Path:
    """Give the DeepSeek-V3 model at ``path`` ``n`` multi-token-prediction layers as the released
    checkpoint stores them (transformers builds none): HF layer ``num_hidden_layers + k`` holds
    random tensors shaped like the last decoder layer's, its own enorm, hnorm, eh_proj and
    shared_head.norm, and copies of the embedding and LM head; config.json says
    ``num_nextn_predict_layers: n``."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(f).items()}
    last, h = config["num_hidden_layers"] - 1, config["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    for k in range(n):
        mtp = f"model.layers.{last + 1 + k}."
        for name, t in list(tensors.items()):
            if name.startswith(f"model.layers.{last}."):
                noise = torch.randn(t.shape, generator=g)
                new = 1 + 0.1 * noise if "norm" in name else noise * (0.1 if name.endswith("bias") else t.std())
                tensors[mtp + name.removeprefix(f"model.layers.{last}.")] = new
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{mtp}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        tensors[mtp + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.05
        tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    for f in [*files, *path.glob("*.safetensors.index.json")]:
        f.unlink()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": n}, indent=2))
    return path


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


# --- a tiny Qwen2.5-VL -------------------------------------------------------------------------

# Token ids of the tiny VLM's vision markers (inside its vocabulary of 1000).
VLM_TOKENS = {
    "image_token_id": 990, "video_token_id": 991, "vision_start_token_id": 992, "vision_end_token_id": 993,
}  # fmt: skip
# A real photo (scikit-image's "chelsea", bundled with loong-data's multimodal sample: package
# data, so it is found in an installed wheel as in the repository).
IMAGE = VLM_SAMPLE_DIR / "images" / "chelsea.jpg"


def make_hf_vlm(path: Path, *, tie: bool = False, seed: int = 0, max_shard_size: str | None = None,
                vision: dict | None = None) -> Path:
    """A tiny random ``Qwen2_5_VLForConditionalGeneration`` (real patch geometry: 14 px, 2 frames,
    merge 2; window attention in block 0, full attention in block 1)."""
    import transformers

    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=None, eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        ),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=40, num_heads=2, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, window_size=56, out_hidden_size=64, fullatt_block_indexes=[1],
            tokens_per_second=2, **(vision or {}),
        ),
        tie_word_embeddings=tie, **VLM_TOKENS,
    )  # fmt: skip
    return _save_random(transformers.Qwen2_5_VLForConditionalGeneration, config, path, seed, max_shard_size)


def _save_random(cls, config, path: Path, seed: int, max_shard_size: str | None) -> Path:
    """A random ``cls(config)`` in fp32, norms and biases perturbed too (so that a swapped tensor
    cannot go unnoticed), saved with ``save_pretrained``."""
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def make_hf_qwen3_vl(path: Path, *, tie: bool = False, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """A tiny random ``Qwen3VLForConditionalGeneration`` (Qwen3-VL's patch geometry: 16 px, 2 frames,
    merge 2; a 6 x 6 learned position table, resized for the image; DeepStack from ViT layers 2
    and 0 into LLM layers 0 and 1, listed out of order so that the order is checked)."""
    import transformers

    config = transformers.Qwen3VLConfig(
        text_config=dict(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True},
        ),
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=36, deepstack_visual_indexes=[2, 0],
        ),
        tie_word_embeddings=tie, **VLM_TOKENS,
    )  # fmt: skip
    return _save_random(transformers.Qwen3VLForConditionalGeneration, config, path, seed, max_shard_size)


def vlm_inputs(image: Path = IMAGE, seed: int = 1, patch_size: int = 14) -> dict[str, torch.Tensor]:
    """Text with one image, as HF's Qwen2-VL image processor prepares it: ``input_ids [1, S]``
    (``<|vision_start|>``, one ``<|image_pad|>`` per merged patch, ``<|vision_end|>`` between random
    text), ``pixel_values [N, 3*2*P*P]``, ``image_grid_thw [1, 3]`` (``patch_size`` P: 14 for
    Qwen2.5-VL, 16 for Qwen3-VL)."""
    import transformers
    from PIL import Image

    unit = 4 * patch_size  # two merge blocks
    proc = transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": unit * unit, "longest_edge": 2 * unit * 3 * unit}, patch_size=patch_size,
        temporal_patch_size=2, merge_size=2,
    )  # fmt: skip
    out = proc(images=[Image.open(image)], return_tensors="pt")
    grid = out["image_grid_thw"]
    n = int(grid.prod()) // 4
    g = torch.Generator().manual_seed(seed)
    t = VLM_TOKENS
    ids = torch.cat([
        torch.randint(0, 990, (10,), generator=g), torch.tensor([t["vision_start_token_id"]]),
        torch.full((n,), t["image_token_id"]), torch.tensor([t["vision_end_token_id"]]),
        torch.randint(0, 990, (12,), generator=g),
    ])[None]  # fmt: skip
    return {"input_ids": ids, "pixel_values": out["pixel_values"], "image_grid_thw": grid}


def hf_vlm_logits(path: Path, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    import transformers

    config = json.loads((Path(path) / "config.json").read_text())
    model = getattr(transformers, config["architectures"][0]).from_pretrained(path, dtype=torch.float32)  # 2.5 / 3
    model.eval()
    ids = inputs["input_ids"]
    # mm_token_type_ids (as the HF processor returns them) make transformers use the 3-D positions
    types = (ids == config["image_token_id"]).long()
    with torch.no_grad():
        return model(**inputs, mm_token_type_ids=types).logits
