"""Reading checkpoint files without running code from them.

A megatron ``torch_dist`` checkpoint holds two kinds of pickles: the DCP ``.metadata`` file
(plain pickle of torch's checkpoint dataclasses) and byte items (RNG states, Transformer Engine
extra states, the common state: ``torch.save`` pickles inside the ``.distcp`` files). Unpickling
can call any importable function, so a crafted checkpoint could run code on load.

Here ``.metadata`` is read by an unpickler that only resolves the classes DCP writes (anything
else is refused, naming it), and every byte item is read with torch's ``weights_only``
unpickler (tensors, containers and primitives only). :func:`vet_checkpoint` applies both to a
whole checkpoint before megatron / torch read it: their own loaders unpickle with the full
unpickler, which, given bytes that only reference allowed classes, calls nothing else.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

METADATA_FILE = ".metadata"
_DCP = "torch.distributed.checkpoint"
# What torch's DCP writes into .metadata (torch 2.x): its dataclasses, torch.Size and dtypes.
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    [(f"{_DCP}.metadata", n) for n in ("BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex",
                                       "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                                       "_MEM_FORMAT_ENCODING")]
    + [(f"{_DCP}.planner", n) for n in ("SavePlan", "TensorWriteData", "WriteItem", "WriteItemType")]
    + [(f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
       ("collections", "OrderedDict")]
    # StorageMeta.checkpoint_id: the path the checkpoint was saved to, when given as a Path
    + [("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")]
)  # fmt: skip


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asks to run code (or build an object) that a checkpoint never needs."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"{self.source}: refers to {module}.{name}, which a checkpoint's metadata never holds; "
            "refusing to load it (checkpoints may only hold torch's checkpoint metadata classes)"
        )


def read_dcp_metadata(path: str | Path) -> Metadata:
    """The DCP metadata of checkpoint directory ``path``, through the allowlisting unpickler."""
    source = Path(path) / METADATA_FILE
    with open(source, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, str(source)).load()
        except UnsafeCheckpointError:
            raise
        except Exception as e:  # truncated or garbled bytes
            raise UnsafeCheckpointError(f"{source}: not readable checkpoint metadata ({e})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{source}: holds a {type(metadata).__name__}, not checkpoint metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's DCP file reader with :func:`read_dcp_metadata` in place of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError(f"{self.path}: per-rank metadata files are not supported")
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_weights_only(data: bytes | io.BytesIO, source: str) -> Any:
    """``torch.load`` of a byte item with torch's allowlisting (``weights_only``) unpickler."""
    buf = data if isinstance(data, io.BytesIO) else io.BytesIO(data)
    try:
        return torch.load(buf, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for a refused global; anything for garbled bytes
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsafeCheckpointError(f"{source}: refused by the weights-only unpickler ({first})") from None


def vet_checkpoint(path: str | Path) -> int:
    """Read every pickle of checkpoint ``path`` with the allowlisting unpicklers; raise
    :class:`UnsafeCheckpointError` naming the file and item that asks for more. Returns the
    number of byte items checked."""
    path = Path(path)
    metadata = read_dcp_metadata(path)
    items = 0
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        source = f"{path / info.relative_path} (item {index.fqn})"
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(f"{source}: transformed (e.g. compressed) items are not supported")
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            load_weights_only(f.read(info.length), source)
        items += 1
    if (common := path / "common.pt").is_file():  # megatron's legacy layout
        load_weights_only(common.read_bytes(), str(common))
    return items
