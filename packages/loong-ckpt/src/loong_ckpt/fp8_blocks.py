"""FP8 block-quantised HF checkpoints (DeepSeek-V3/R1's released weights), dequantised on read.

Such a checkpoint stores each quantised linear weight ``W`` as ``float8_e4m3fn`` plus
``<name>_scale_inv`` of shape ``[ceil(rows / b0), ceil(cols / b1)]``, one scale per
``weight_block_size = [b0, b1]`` block; its config.json says ``quantization_config:
{quant_method: fp8, weight_block_size: [b0, b1]}``. The value is ``W_fp8 * scale_inv`` per block.
"""

from __future__ import annotations

from typing import Any

import torch

from loong_ckpt.hf_config import ConversionError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def block_size(config: dict[str, Any], source: str) -> tuple[int, int] | None:
    """The weight block size of an FP8 block-quantised checkpoint; None when it is not quantised."""
    q = config.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise ConversionError(f"{source}: quantization_config.quant_method={q.get('quant_method')!r}; "
                              "only FP8 block quantisation (fp8) is dequantised on load")  # fmt: skip
    size = q.get("weight_block_size")
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size)):
        raise ConversionError(f"{source}: quantization_config.weight_block_size={size!r}; expected [rows, cols]")
    return size[0], size[1]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (FP8, [rows, cols]) times its per-block ``scale_inv``, in ``dtype`` (via fp32)."""
    rows, cols = weight.shape
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ConversionError(f"FP8 weight {tuple(weight.shape)} with blocks {list(block)} needs scales "
                              f"{want}, got {tuple(scale_inv.shape)}")  # fmt: skip
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, as DeepSeek's released checkpoints were made: per block, scale the largest
    magnitude to e4m3's maximum (448). Returns (FP8 weight, scale_inv)."""
    rows, cols = weight.shape
    nb = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(nb[0] * block[0], nb[1] * block[1])
    padded[:rows, :cols] = weight.float()
    blocks = padded.reshape(nb[0], block[0], nb[1], block[1])
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn).reshape(padded.shape)[:rows, :cols]
    return q.contiguous(), scale_inv
