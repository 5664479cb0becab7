"""Loong vs HF transformers: VLM training throughput (Qwen2.5-VL-style) on one GPU, in one run.

Both sides train the same shape (default: Qwen2.5-VL-3B's vision tower and language model, the
language model cut to --text-layers so AdamW fits one 80 GB GPU; random init) on the same
micro-batches: real bundled images resized to --image-size (448x448: 1024 patches, 256 image
tokens each), --images-per-sample images with their real captions per sample, packed into
--seq-token sequences by the train app's multimodal data path (the HF worker builds its
micro-batches with the same code, config and seed, and checks they hold the same tokens and
images). bf16 with fp32 master weights, AdamW (lr 3e-4, betas 0.9/0.95, wd 0.1, clip 1.0).
Loong runs the real train app (`--config-name vlm`, TE layers when transformer-engine is
installed, THD packing: attention stays inside each sample); HF runs
Qwen2_5_VLForConditionalGeneration with SDPA under torch.autocast, fed each pack as one causal
sequence (HF's SDPA path has no packed-sequence attention; it attends across the samples of a
pack, more attention work than Loong does). Each side runs in its own process; the table reports
the median over the steps after warm-up.

    python bench/vlm_throughput.py                        # both, default shape
    python bench/vlm_throughput.py --text-layers 36 --steps 20 --warmup 5
    python bench/vlm_throughput.py --loong-extra model.layer_backend=local

tokens/s counts LLM tokens (image tokens included, padding excluded). MFU = step FLOPs / step
time / 989 TFLOP/s, step FLOPs = LLM (6 N + 6 L h s) per token (DESIGN.md) + vision tower
(bench/vlm_flops.py: 6 N per patch + bidirectional attention over the frame or window).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vlm_flops import PEAK_BF16, StepCounts, VisionShape, llm_flops, step_counts  # noqa: E402


@dataclass(frozen=True)
class TextShape:
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool
    rope_theta: float
    mrope_section: tuple[int, ...]
    norm_eps: float
    max_position_embeddings: int

    def num_parameters(self) -> int:
        """Qwen2 LLM: qkv with bias, o without, gated MLP, two RMSNorms per layer, final norm."""
        h, f, d = self.hidden, self.ffn, self.head_dim
        q, kv = self.heads * d, self.kv_heads * d
        attn = h * q + q + 2 * (h * kv + kv) + q * h
        layer = attn + 3 * h * f + 2 * h
        emb = self.vocab * h * (1 if self.tie_embeddings else 2)
        return emb + self.num_layers * layer + h


@dataclass(frozen=True)
class BenchShape:
    text: TextShape
    vision: VisionShape
    vision_heads: int

    def step_flops(self, counts: StepCounts, seq: int) -> float:
        t = self.text
        return llm_flops(t.num_parameters(), t.num_layers, t.hidden, seq, counts.tokens) + counts.vision_flops


def bench_shape(model) -> BenchShape:
    """The shape of a Loong VLM ModelConfig (Qwen2.5-VL ViT + patch merger + Qwen2 LLM), which
    both sides build: Loong from the config, HF through :func:`hf_config`."""
    f, e = model.foundation, model.image_encoder
    text = TextShape(
        num_layers=f.num_layers, hidden=f.hidden_size, ffn=f.ffn_hidden_size, heads=f.num_attention_heads,
        kv_heads=f.query_groups, head_dim=f.head_dim, vocab=f.vocab_size, tie_embeddings=f.tie_word_embeddings,
        rope_theta=f.rotary_base, mrope_section=tuple(f.mrope_section), norm_eps=f.norm_epsilon,
        max_position_embeddings=f.max_position_embeddings,
    )  # fmt: skip
    vision = VisionShape(
        depth=e.num_layers, hidden=e.hidden_size, ffn=e.ffn_hidden_size, out_hidden=f.hidden_size,
        patch=e.patch_size, temporal_patch=e.temporal_patch_size, merge=e.spatial_merge_size,
        window_size=e.window_size, fullatt_blocks=tuple(e.fullatt_block_indexes), in_channels=e.in_channels,
    )  # fmt: skip
    return BenchShape(text, vision, e.num_attention_heads)


def hf_config(shape: BenchShape, token_ids: dict[str, int]):
    """The transformers config of the same shape, vision token ids from the tokenizer."""
    from transformers import Qwen2_5_VLConfig

    t, v = shape.text, shape.vision
    if t.head_dim * t.heads != t.hidden:
        raise ValueError(f"HF Qwen2.5-VL needs head dim = hidden / heads; the model has {t.head_dim} x {t.heads} "
                         f"!= {t.hidden}")  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=t.vocab, hidden_size=t.hidden, intermediate_size=t.ffn, num_hidden_layers=t.num_layers,
            num_attention_heads=t.heads, num_key_value_heads=t.kv_heads, rms_norm_eps=t.norm_eps,
            max_position_embeddings=t.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta, "mrope_section": list(t.mrope_section)},
        ),
        vision_config=dict(
            depth=v.depth, hidden_size=v.hidden, intermediate_size=v.ffn, num_heads=shape.vision_heads,
            out_hidden_size=v.out_hidden, patch_size=v.patch, temporal_patch_size=v.temporal_patch,
            spatial_merge_size=v.merge, window_size=v.window_size, fullatt_block_indexes=list(v.fullatt_blocks),
        ),
        tie_word_embeddings=t.tie_embeddings,
        **token_ids,
        attn_implementation="sdpa",
    )  # fmt: skip


def hf_inputs(mb: dict, image_token_id: int, video_token_id: int) -> dict:
    """One packed micro-batch of the contract as HF Qwen2.5-VL inputs. HF shifts labels itself
    (position i predicts labels[i + 1]); the contract's labels are already next-token targets,
    so they move one place right, with -100 where the loss mask is zero."""
    import torch

    tokens = mb["tokens"]
    targets = torch.where(mb["loss_mask"] > 0, mb["labels"], torch.full_like(mb["labels"], -100))
    labels = torch.cat([torch.full_like(targets[:, :1], -100), targets[:, :-1]], dim=1)
    mm_types = (tokens == image_token_id).int() + 2 * (tokens == video_token_id).int()
    out = {"input_ids": tokens, "labels": labels, "mm_token_type_ids": mm_types}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
        if key in mb:
            out[key] = mb[key]
    return out
