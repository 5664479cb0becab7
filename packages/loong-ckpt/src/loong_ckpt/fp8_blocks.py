"""FP8 block-quantised HF checkpoints (DeepSeek-V3/R1's released weights), dequantised on read.

Such a checkpoint stores each quantised linear weight ``W`` as ``float8_e4m3fn`` plus
``<name>_scale_inv`` of shape ``[ceil(rows / b0), ceil(cols / b1)]``, one scale per
``weight_block_size = [b0, b1]`` block; its config.json says ``quantization_config:
{quant_method: fp8, weight_block_size: [b0, b1]}``. The value is ``W_fp8 * scale_inv`` per block.
"""

from __future__ import annotations

import re
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


# The weights DeepSeek's release stores in FP8: the attention and MLP (dense, expert, shared)
# projections of decoder layers; embeddings, norms, the router and the LM head stay in bf16.
_QUANTISED = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\..*proj\.weight$")


def quantization_config(block: tuple[int, int]) -> dict[str, Any]:
    """config.json's ``quantization_config`` of a checkpoint written with FP8 blocks."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}


def parse_block(text: str) -> tuple[int, int]:
    """``"128"`` or ``"128,128"`` (rows, cols) -> the block size; anything else is refused."""
    parts = text.split(",")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ConversionError(f"--fp8-blocks={text!r}; expected a block size such as 128 or 128,128")
    return int(parts[0]), int(parts[-1])


class BlockWriter:
    """A safetensors writer that stores each quantised weight as FP8 + ``_scale_inv`` (the
    release format), every other tensor unchanged. ``plan`` is the plain (name, shape, dtype) list."""

    def __init__(self, make_writer: Any, plan: list[tuple[str, tuple[int, ...], torch.dtype]],
                 block: tuple[int, int]) -> None:  # fmt: skip
        self.block = block
        out = []
        for name, shape, dtype in plan:
            if self.quantised(name, shape):
                scales = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
                out += [(name, shape, torch.float8_e4m3fn), (name + SCALE_SUFFIX, scales, torch.float32)]
            else:
                out.append((name, shape, dtype))
        self.writer = make_writer(out)
        self.shapes = {name: shape for name, shape, _ in plan}

    @staticmethod
    def quantised(name: str, shape: tuple[int, ...]) -> bool:
        return len(shape) == 2 and _QUANTISED.match(name) is not None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if not self.quantised(name, self.shapes[name]):
            return self.writer.write(name, tensor)
        q, scale_inv = quantize(tensor, self.block)
        self.writer.write(name, q)
        self.writer.write(name + SCALE_SUFFIX, scale_inv)
        return None

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.abort()
