"""HF directories: read tensors (or slices) one at a time, write safetensors shards streaming.

Reading opens the safetensors file per tensor (``safe_open`` maps the file; closing it drops the
mapped pages), so the resident memory of a conversion stays at the size of the tensors in flight.
Writing streams too: shapes and dtypes are known before any data is read, so each shard's header
is written first and the tensors follow one by one.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from loong_ckpt.fp8_blocks import FP8_DTYPES, SCALE_SUFFIX, block_size, dequantize
from loong_ckpt.hf_config import ConversionError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)  # fmt: skip

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def is_hf_dir(path: str | Path) -> bool:
    """An HF model directory: config.json next to safetensors weights."""
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and ((p / INDEX_FILE).is_file() or (p / SINGLE_FILE).is_file())


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype


class HFReader:
    """Tensors of an HF directory by name, with shape / dtype known up front (headers only).
    ``weights`` is the safetensors file stem (``model``; diffusers: ``diffusion_pytorch_model``)."""

    def __init__(self, path: str | Path, weights: str = "model") -> None:
        self.single_file, self.index_file = f"{weights}.safetensors", f"{weights}.safetensors.index.json"
        self.path = Path(path)
        self.config: dict[str, Any] = self.read_config(self.path)
        self.tensors: dict[str, TensorInfo] = {}
        for file in self._files():
            with _unreadable_names(file), safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    sl = f.get_slice(name)
                    self.tensors[name] = TensorInfo(file, tuple(sl.get_shape()), _ST_DTYPES[sl.get_dtype()])
        self._fp8_scales = self._fp8_weights()

    def _fp8_weights(self) -> dict[str, TensorInfo]:
        """FP8 block-quantised weights (fp8_blocks.py) -> their scale tensors, which leave the
        listing; the weights are listed in the model's dtype and dequantised on read."""
        block = block_size(self.config, str(self.path / CONFIG_FILE))
        if block is None:
            return {}
        self._fp8_block = block
        out_dtype = getattr(torch, self.config.get("torch_dtype") or self.config.get("dtype") or "bfloat16")
        scales = {}
        for name, info in list(self.tensors.items()):
            if info.dtype in FP8_DTYPES:
                if name + SCALE_SUFFIX not in self.tensors:
                    raise ConversionError(f"{self.path}: FP8 tensor {name} has no {name + SCALE_SUFFIX}")
                scales[name] = self.tensors[name + SCALE_SUFFIX]
                self.tensors[name] = TensorInfo(info.file, info.shape, out_dtype)
        for name in scales:
            del self.tensors[name + SCALE_SUFFIX]
        return scales

    @staticmethod
    def read_config(path: Path) -> dict[str, Any]:
        cfg = path / CONFIG_FILE
        if not cfg.is_file():
            raise ConversionError(f"{cfg} is missing: not an HF model directory")
        try:
            return json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ConversionError(f"{cfg}: invalid JSON ({e})") from None

    def _files(self) -> list[Path]:
        index = self.path / self.index_file
        if index.is_file():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise ConversionError(f"{index}: expected a JSON object with a 'weight_map' ({e})") from None
            files = sorted(set(weight_map.values()))
            for name in files:
                if not (self.path / name).is_file():
                    owners = [k for k, v in weight_map.items() if v == name]
                    raise ConversionError(
                        f"{index}: shard {name} is listed (holding {owners[0]} and {len(owners) - 1} more) "
                        f"but {self.path / name} does not exist"
                    )
            return [self.path / n for n in files]
        single = self.path / self.single_file
        if single.is_file():
            return [single]
        raise ConversionError(f"{self.path}: no {self.index_file} or {self.single_file} found")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ConversionError(f"{self.path}: tensor {name} is missing from the safetensors files") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        info = self.info(name)
        if name in self._fp8_scales:  # whole weight, then the slice: scales cover blocks, not rows
            scale_file = self._fp8_scales[name].file
            with _unreadable_names(info.file), safe_open(info.file, framework="pt") as f, \
                    safe_open(scale_file, framework="pt") as g:
                t = dequantize(f.get_tensor(name), g.get_tensor(name + SCALE_SUFFIX), self._fp8_block, info.dtype)
            return t if dim is None else t.narrow(dim, start, (stop if stop is not None else t.shape[dim]) - start)
        with _unreadable_names(info.file), safe_open(info.file, framework="pt") as f:
            if dim is None:
                return f.get_tensor(name)
            index: list[slice] = [slice(None)] * dim + [slice(start, stop)]
            return f.get_slice(name)[tuple(index)].contiguous()


@contextmanager
def _unreadable_names(file: Path) -> Iterator[None]:
    """A truncated or garbage safetensors file fails as a ConversionError naming it, not as a raw
    SafetensorError (or the OSError of a short read)."""
    try:
        yield
    except (SafetensorError, OSError) as e:
        raise ConversionError(f"{file}: not a readable safetensors file ({e}); it is truncated or corrupt") from None


def copy_tokenizer_files(src: str | Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, dst / name)
            copied.append(name)
    return copied


class SafetensorsWriter:
    """Writes tensors, in the order of ``plan`` (name, shape, dtype), into shards of at most
    ``max_shard_bytes`` (a larger tensor gets a shard of its own), plus the index file."""

    def __init__(
        self, out: Path, plan: Iterable[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int,
        weights: str = "model",
    ) -> None:
        self.out, self.weights = out, weights
        shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for name, shape, dtype in plan:
            nbytes = _nbytes(shape, dtype)
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, shape, dtype))
            size += nbytes
        n = len(shards)
        self._files = [f"{weights}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._shards = shards
        self._order = [name for shard in shards for name, _, _ in shard]
        self._pos = 0
        self._shard = -1
        self._remaining = 0
        self._stream = None
        self.total_bytes = sum(_nbytes(s, d) for shard in shards for _, s, d in shard)

    def _open_next(self) -> None:
        self._shard += 1
        entries, offset = {}, 0
        for name, shape, dtype in self._shards[self._shard]:
            nbytes = _nbytes(shape, dtype)
            entries[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        self._stream = open(self.out / self._files[self._shard], "wb")  # noqa: SIM115 (closed in write/close)
        self._stream.write(struct.pack("<Q", len(header)) + header)
        self._remaining = len(self._shards[self._shard])

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._order[self._pos]
        if name != expected:
            raise RuntimeError(f"safetensors writer: got {name}, expected {expected} next")
        if self._remaining == 0:
            self._open_next()
        _, shape, dtype = self._shards[self._shard][len(self._shards[self._shard]) - self._remaining]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise RuntimeError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {shape} {dtype}")
        data = tensor.detach().contiguous().cpu().reshape(-1)
        if data.numel():
            self._stream.write(memoryview(data.view(torch.uint8).numpy()))
        self._pos += 1
        self._remaining -= 1
        if self._remaining == 0:
            self._stream.close()
            self._stream = None

    def close(self) -> None:
        if self._pos != len(self._order):
            raise RuntimeError(f"safetensors writer: {len(self._order) - self._pos} planned tensors not written")
        weight_map = {name: self._files[i] for i, shard in enumerate(self._shards) for name, _, _ in shard}
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out / f"{self.weights}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()
