"""What every offline converter (HF, diffusers, PEFT) shares about its output: the result it
reports, the output dtype it accepts and the directory it writes atomically."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from loong_ckpt.hf_config import ConversionError
from loong_ckpt.training import PARTIAL_SUFFIX
from loong_xpu.backends.cpu import peak_rss_bytes

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ConvertResult:
    path: Path
    seconds: float
    peak_rss_mib: float
    tensors: int
    command: str | None = None  # for hf-to-mcore: the train command that starts from it
    model_name: str | None = None


def peak_rss_mib() -> float:
    """This process's own peak resident memory (MiB), not its parent's (see
    :func:`loong_xpu.backends.cpu.peak_rss_bytes`)."""
    return peak_rss_bytes() / 2**20


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name in (None, "auto"):
        return None
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConversionError(f"dtype {name!r}; allowed: auto, {', '.join(_DTYPES)}") from None


def check_output_dir(out: Path, force: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ConversionError(f"output directory {out} exists and is not empty; pass --force to replace it")


@contextlib.contextmanager
def atomic_output_dir(out: Path, force: bool) -> Iterator[Path]:
    """Yield ``<out>.partial``; on success it replaces ``out``; on failure it is removed."""
    check_output_dir(out, force)
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        partial.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        partial.rename(out)
