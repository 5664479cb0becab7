"""Conversion memory stays bounded: the peak RSS of converting a model does not grow with its
number of layers (the README's claim, measured there on 1B / 2B models), in both directions."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

HIDDEN, FFN, VOCAB = 1024, 4096, 512
LAYER_MIB = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN) * 2 / 2**20  # bf16: 32 MiB a layer


def _write_hf(path: Path, num_layers: int) -> Path:
    """An HF Llama directory of ``num_layers`` (zeros: the values do not matter here), one
    safetensors shard per layer as large checkpoints are sharded."""
    from transformers import LlamaConfig

    path.mkdir()
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=num_layers,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=VOCAB, tie_word_embeddings=True,
                         max_position_embeddings=512, torch_dtype="bfloat16")  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    z = lambda *shape: torch.zeros(*shape, dtype=torch.bfloat16)  # noqa: E731
    shards = {"embed.safetensors": {"model.embed_tokens.weight": z(VOCAB, HIDDEN), "model.norm.weight": z(HIDDEN)}}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shards[f"layer{i:03d}.safetensors"] = {
            **{f"{p}self_attn.{n}_proj.weight": z(HIDDEN, HIDDEN) for n in "qkvo"},
            f"{p}mlp.gate_proj.weight": z(FFN, HIDDEN), f"{p}mlp.up_proj.weight": z(FFN, HIDDEN),
            f"{p}mlp.down_proj.weight": z(HIDDEN, FFN),
            f"{p}input_layernorm.weight": z(HIDDEN), f"{p}post_attention_layernorm.weight": z(HIDDEN),
        }  # fmt: skip
    for name, tensors in shards.items():
        save_file(tensors, path / name, metadata={"format": "pt"})
    weight_map = {k: name for name, tensors in shards.items() for k in tensors}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _peak_rss_mib(*args: str) -> float:
    proc = subprocess.run([sys.executable, "-m", "loong_ckpt.cli", *args, "--no-progress"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(re.search(r"peak RSS (\d+) MiB", proc.stdout).group(1))


@pytest.mark.xfail(
    strict=True,
    reason="found by this test: on this shape (layers dominate, a 1 MiB embedding) the peak grows "
    "~25 MiB per 32 MiB layer in both directions (2 -> 10 layers: 861 -> 1071 MiB hf-to-mcore, 880 -> 1071 "
    "MiB mcore-to-hf); the README's measurement had a 0.5 GiB embedding dominating. Not fixed yet.",
)
def test_peak_rss_of_a_conversion_does_not_grow_with_the_number_of_layers(tmp_path):
    peaks = {}
    for layers in (2, 10):
        hf = _write_hf(tmp_path / f"hf{layers}", layers)
        peaks[layers] = (_peak_rss_mib("hf-to-mcore", str(hf), str(tmp_path / f"mcore{layers}")),
                         _peak_rss_mib("mcore-to-hf", str(tmp_path / f"mcore{layers}"), str(tmp_path / f"back{layers}")))
    grown = 8 * LAYER_MIB  # 256 MiB more weights
    for direction, small, large in zip(("hf-to-mcore", "mcore-to-hf"), peaks[2], peaks[10]):
        # a loader that held the model would grow by `grown`; streaming stays within ~2 layers
        assert large - small < 2 * LAYER_MIB, f"{direction}: {small:.0f} -> {large:.0f} MiB for +{grown:.0f} MiB"
