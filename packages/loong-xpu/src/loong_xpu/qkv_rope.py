"""megatron's fused-QKV RoPE through loong-kernels' TileLang kernel where that kernel runs.

With ``fused_single_qkv_rope`` (Loong's ``model.fused_qkv_rope``) megatron's attention splits its
fused QKV projection and rotates q and k in one call, ``apply_fused_qkv_rotary_pos_emb``, bound
from TE. On an H100 TE's kernels took 0.51 ms forward + 0.52 ms backward per llama3.2-1b layer at
micro-batch 12 (16.4 ms of a 750 ms step), about 1.2 TB/s for a pass that only moves memory.
:func:`apply_fused_qkv_rotary_pos_emb` has TE's signature: the plain case (sbhd, no start
positions, not interleaved, no context parallelism, RoPE over whole heads) goes to
``loong_kernels.qkv_rope`` when loong-kernels is installed and its TileLang kernel runs these
inputs; every other call, and every call without them, runs TE's function as before.

loong-kernels depends on loong-xpu, not the other way: it is imported here when first called, and
its absence means TE's kernel.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

TARGET = "megatron.core.transformer.attention:apply_fused_qkv_rotary_pos_emb"


def make_fused_qkv_rope(accel: object = None):
    """The function the manifest binds in megatron's attention module."""
    return apply_fused_qkv_rotary_pos_emb


@functools.cache
def _loong_kernels_qkv_rope():
    """``loong_kernels.ops.qkv_rope``, or None where loong-kernels is not installed; looked up once,
    not on every attention layer's call."""
    if importlib.util.find_spec("loong_kernels") is None:
        return None
    return importlib.import_module("loong_kernels.ops.qkv_rope")


def apply_fused_qkv_rotary_pos_emb(
    qkv: torch.Tensor,
    q_freqs: torch.Tensor,
    k_freqs: torch.Tensor,
    qkv_split_arg_list: list[int],
    tensor_format: str = "sbhd",
    start_positions: torch.Tensor | None = None,
    interleaved: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q_width, k_width, v_width = qkv_split_arg_list
    plain = (tensor_format == "sbhd" and start_positions is None and not interleaved and cp_size == 1
             and k_width == v_width and q_width % k_width == 0 and q_freqs.shape[-1] == k_freqs.shape[-1] == k_width)  # fmt: skip
    ops = _loong_kernels_qkv_rope() if plain else None
    if ops is not None and ops.qkv_rope_uses_tilelang(qkv, q_width // k_width):
        return ops.qkv_rope(qkv, q_freqs, k_freqs, q_width // k_width)
    from transformer_engine.pytorch.attention.rope import apply_fused_qkv_rotary_pos_emb as te_rope

    return te_rope(qkv, q_freqs, k_freqs, qkv_split_arg_list, tensor_format, start_positions, interleaved, cu_seqlens,
                   cp_size, cp_rank)  # fmt: skip
