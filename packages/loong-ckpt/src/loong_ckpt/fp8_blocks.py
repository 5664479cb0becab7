"""FP8 block-quantised HF checkpoints (DeepSeek-V3/R1's released weights), dequantised on read.

Such a checkpoint stores each quantised linear weight ``W`` as ``float8_e4m3fn`` plus
``<name>_scale_inv`` of shape ``[ceil(rows / b0), ceil(cols / b1)]``, one scale per
``weight_block_size = [b0, b1]`` block; its config.json says ``quantization_config:
{quant_method: fp8, weight_block_size: [b0, b1]}`` (DeepSeek-V3.2's adds ``scale_fmt: ue8m0``:
power-of-two scales). The value is ``W_fp8 * scale_inv`` per block. Which weights are quantised
is the family's :class:`Fp8Layout` (export only: import dequantises whatever is FP8).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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
    if q.get("scale_fmt") not in (None, "ue8m0"):  # ue8m0: power-of-two fp32 scales, read as any
        raise ConversionError(
            f"{source}: quantization_config.scale_fmt={q.get('scale_fmt')!r}; allowed: ue8m0"
        )
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


def quantize(
    weight: torch.Tensor, block: tuple[int, int], scale_fmt: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, as DeepSeek's released checkpoints were made: per block, scale the largest
    magnitude to e4m3's maximum (448); ``scale_fmt="ue8m0"`` rounds each scale up to a power of
    two (DeepSeek-V3.1 / V3.2's format), so the largest magnitude lands in (224, 448]. Returns
    (FP8 weight, scale_inv)."""
    rows, cols = weight.shape
    nb = (-(-rows // block[0]), -(-cols // block[1]))
    padded = torch.zeros(nb[0] * block[0], nb[1] * block[1])
    padded[:rows, :cols] = weight.float()
    blocks = padded.reshape(nb[0], block[0], nb[1], block[1])
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    if scale_fmt == "ue8m0":
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    q = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn).reshape(padded.shape)[:rows, :cols]
    return q.contiguous(), scale_inv


@dataclass(frozen=True)
class Fp8Layout:
    """Which weights a release stores as FP8 blocks, and the format of their scales."""

    quantised: re.Pattern[str]
    scale_fmt: str | None = None  # "ue8m0": every scale a power of two
    fp32: re.Pattern[str] | None = None  # tensors the release keeps in fp32 (written so, exactly)

    def config(self, block: tuple[int, int]) -> dict[str, Any]:
        """config.json's ``quantization_config`` of a checkpoint written in this layout."""
        q: dict[str, Any] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}
        if self.scale_fmt:
            q["scale_fmt"] = self.scale_fmt
        return {**q, "weight_block_size": list(block)}


# DeepSeek-V3/R1's release: the attention and MLP (dense, expert, shared) projections of decoder
# and MTP layers; embeddings, norms, the router, the MTP layer's eh_proj and the LM head stay bf16.
DEEPSEEK_V3 = Fp8Layout(re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\..*proj\.weight$"))
# DeepSeek-V3.2(-Exp)'s release: V3's, plus the indexer's wq_b and wk; its weights_proj stays bf16
# and its k_norm fp32; scales in UE8M0 (powers of two), which its quantization_config names.
DEEPSEEK_V32 = Fp8Layout(
    re.compile(
        r"^model\.layers\.\d+\.(self_attn\.(indexer\.(wq_b|wk)|[a-z_]*proj[a-z_]*)|mlp\..*proj)\.weight$"
    ),
    scale_fmt="ue8m0",
    fp32=re.compile(r"^model\.layers\.\d+\.self_attn\.indexer\.k_norm\.(weight|bias)$"),
)
# Family -> its release's layout; other families are written in DeepSeek-V3's.
FP8_LAYOUTS: dict[str, Fp8Layout] = {"deepseek-v3": DEEPSEEK_V3, "deepseek-v32": DEEPSEEK_V32}


def fp8_layout(family: str) -> Fp8Layout:
    return FP8_LAYOUTS.get(family, DEEPSEEK_V3)


def parse_block(text: str) -> tuple[int, int]:
    """``"128"`` or ``"128,128"`` (rows, cols) -> the block size; anything else is refused."""
    parts = text.split(",")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ConversionError(f"--fp8-blocks={text!r}; expected a block size such as 128 or 128,128")
    return int(parts[0]), int(parts[-1])


class BlockWriter:
    """A safetensors writer that stores each quantised weight as FP8 + ``_scale_inv`` and the
    layout's fp32 tensors in fp32 (the release format), every other tensor unchanged. ``plan`` is
    the plain (name, shape, dtype) list."""

    def __init__(self, make_writer: Any, plan: list[tuple[str, tuple[int, ...], torch.dtype]],
                 block: tuple[int, int], layout: Fp8Layout = DEEPSEEK_V3) -> None:  # fmt: skip
        self.block, self.layout = block, layout
        out = []
        for name, shape, dtype in plan:
            if self.quantised(name, shape):
                scales = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
                out += [(name, shape, torch.float8_e4m3fn), (name + SCALE_SUFFIX, scales, torch.float32)]
            else:
                out.append((name, shape, torch.float32 if self.fp32(name) else dtype))
        self.writer = make_writer(out)
        self.shapes = {name: shape for name, shape, _ in plan}

    def quantised(self, name: str, shape: tuple[int, ...]) -> bool:
        return len(shape) == 2 and self.layout.quantised.match(name) is not None

    def fp32(self, name: str) -> bool:
        return self.layout.fp32 is not None and self.layout.fp32.match(name) is not None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if not self.quantised(name, self.shapes[name]):
            return self.writer.write(name, tensor.float() if self.fp32(name) else tensor)
        q, scale_inv = quantize(tensor, self.block, self.layout.scale_fmt)
        self.writer.write(name, q)
        self.writer.write(name + SCALE_SUFFIX, scale_inv)
        return None

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.abort()
