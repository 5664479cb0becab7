"""Megatron distributed checkpoints (``torch_dist`` format) written and read piecewise.

A megatron ``torch_dist`` checkpoint is a torch.distributed.checkpoint (DCP) directory whose
entries are keyed by ShardedTensor keys, holding GLOBAL tensors as chunks (per-layer keys have the
layer as first axis), plus ``metadata.json`` naming the backend and a ``common_state`` object.

Writing: a DCP :class:`SavePlanner` whose plan lists every chunk up front (shapes are known from
the model template) and whose ``resolve_data`` computes each chunk only when the writer asks for
it; DCP's file writer takes one item at a time, so memory holds a few tensors, never the model.
Reading: a DCP :class:`LoadPlanner` that fills caller-provided buffers with any region of any
key, whatever layout (TP / PP) the checkpoint was written with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from loong_ckpt.safe_load import SafeFileSystemReader
from loong_models import FoundationConfig

MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
COMMON_STATE_KEY = "common_state/shard_0_1"  # megatron's ShardedObject("common_state", ..., (1,), (0,))


@dataclass
class Template:
    """What a model's checkpoint holds: tensor keys with global shapes, and object keys."""

    tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)
    layered: set[str] = field(default_factory=set)  # keys whose first axis is the layer
    objects: list[str] = field(default_factory=list)  # ShardedObject unique keys (e.g. _extra_state)


@contextlib.contextmanager
def _single_process_megatron() -> Iterator[None]:
    """A world of one (gloo) with megatron's TP=PP=1 groups, unless the caller already has them."""
    from megatron.core import parallel_state as mpu

    import loong_xpu

    created_pg = created_mpu = False
    with loong_xpu.redirect_cuda(loong_xpu.get_accelerator("cpu")), tempfile.TemporaryDirectory() as tmp:
        if not dist.is_initialized():
            store = dist.FileStore(os.path.join(tmp, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            created_pg = True
        if not mpu.model_parallel_is_initialized():
            mpu.initialize_model_parallel(1, 1)
            created_mpu = True
        elif mpu.get_tensor_model_parallel_world_size() != 1 or mpu.get_pipeline_model_parallel_world_size() != 1:
            raise RuntimeError("building a checkpoint template needs TP=PP=1 (or no megatron groups yet)")
        try:
            yield
        finally:
            if created_mpu:
                mpu.destroy_model_parallel()
            if created_pg:
                dist.destroy_process_group()


def model_template(cfg: FoundationConfig | Any) -> Template:
    """The checkpoint entries of the model loong_models builds for ``cfg`` (built on the meta
    device: no memory, no initialisation), as the unwrapped model's sharded_state_dict names them:
    a GPTModel for a FoundationConfig, the composed model for a ModelConfig with an image encoder."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    from loong_ckpt.components import foundation_of, is_composed
    from loong_models import build_foundation, build_model, build_transformer_config

    with _single_process_megatron():
        tconfig = build_transformer_config(
            foundation_of(cfg), use_cpu_initialization=True, perform_initialization=False,
            params_dtype=torch.float32,
        )  # fmt: skip
        with torch.device("meta"):
            if is_composed(cfg):
                local = dataclasses.replace(cfg, layer_backend="local")
                model = build_model(local, tconfig, device_type="cpu")
            else:
                model = build_foundation(cfg, tconfig, layer_backend="local")
        sharded = model.sharded_state_dict()
    out = Template()
    items = []
    for v in sharded.values():
        items.extend(_flatten(v.build()) if isinstance(v, ShardedTensorFactory) else [v])
    for sh in items:
        if isinstance(sh, ShardedTensor):
            out.tensors[sh.key] = tuple(sh.global_shape)
            if sh.prepend_axis_num:
                out.layered.add(sh.key)
        elif isinstance(sh, ShardedObject) and sh.unique_key not in out.objects:
            out.objects.append(sh.unique_key)
    return out


def _flatten(x) -> list:
    if isinstance(x, dict):
        return [y for v in x.values() for y in _flatten(v)]
    if isinstance(x, list | tuple):
        return [y for v in x for y in _flatten(v)]
    return [x]


@contextlib.contextmanager
def _unwrapped_errors() -> Iterator[None]:
    """DCP wraps every failure in a CheckpointException (a BaseException); re-raise the original
    so that a ConversionError naming the key, or an OSError naming the file, reaches the user."""
    try:
        yield
    except CheckpointException as e:
        failures = list(e.failures.values())
        if failures and isinstance(failures[0][0], Exception):
            raise failures[0][0] from None
        raise


# --- writing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """One piece of a global tensor: ``key`` at ``offsets`` with ``sizes``."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype


def _torch_save_bytes(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save([obj], buf)  # megatron stores a ShardedObject as a list of its shards' data
    buf.seek(0)
    return buf


class _LazySavePlanner(SavePlanner):
    def __init__(self, chunks: Sequence[Chunk], objects: Sequence[str], compute: Callable[[Chunk], torch.Tensor]):
        self.compute = compute
        self.by_index: dict[tuple[str, tuple[int, ...]], Chunk] = {}
        items = []
        for c in chunks:
            whole = c.sizes == c.global_shape
            items.append(
                WriteItem(
                    index=MetadataIndex(c.key, torch.Size(c.offsets)),
                    type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                        properties=TensorProperties(dtype=c.dtype),
                        size=torch.Size(c.global_shape),
                    ),
                )
            )
            self.by_index[(c.key, tuple(c.offsets))] = c
        for key in [*objects, COMMON_STATE_KEY]:
            items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        self.items = items

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        pass  # the plan was fixed in __init__ from the template's shapes; nothing to inspect here

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self.items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return _torch_save_bytes({} if write_item.index.fqn == COMMON_STATE_KEY else None)
        chunk = self.by_index[(write_item.index.fqn, tuple(write_item.index.offset))]
        t = self.compute(chunk)
        if tuple(t.shape) != chunk.sizes:
            raise RuntimeError(f"{chunk.key}: computed shape {tuple(t.shape)}, planned {chunk.sizes}")
        return t.to(chunk.dtype).contiguous()


def write_checkpoint(
    path: Path, chunks: Sequence[Chunk], objects: Sequence[str], compute: Callable[[Chunk], torch.Tensor]
) -> None:
    """Write a megatron torch_dist checkpoint into ``path`` (an existing, empty directory), calling
    ``compute(chunk)`` for each chunk's data as the writer reaches it."""
    writer = FileSystemWriter(str(path), single_file_per_rank=True, thread_count=1, sync_files=True)
    with _unwrapped_errors():
        dcp.save({}, storage_writer=writer, planner=_LazySavePlanner(chunks, objects, compute), no_dist=True)
    (path / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))


# --- reading ----------------------------------------------------------------------------------


def read_metadata(path: str | Path) -> dict[str, TensorStorageMetadata]:
    """Tensor entries of a megatron / DCP checkpoint: key -> global size, dtype, stored chunks."""
    md = SafeFileSystemReader(str(path)).read_metadata()
    return {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


class _RegionLoadPlanner(LoadPlanner):
    def __init__(self, regions: dict[str, tuple[tuple[int, ...], torch.Tensor]]) -> None:
        self.regions = regions

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for key, (offsets, buf) in self.regions.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=buf.shape)
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise RuntimeError(f"unexpected object {read_item.dest_index.fqn}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        buf = self.regions[read_item.dest_index.fqn][1]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            buf = buf.narrow(dim, start, length)
        return buf

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out views of the destination buffers: data is already in place


def read_regions(path: str | Path, regions: dict[str, tuple[tuple[int, ...], torch.Tensor]]) -> None:
    """Fill each buffer with the region of its key that starts at ``offsets`` (buffer-sized)."""
    if regions:
        with _unwrapped_errors():
            dcp.load(dict.fromkeys(regions), storage_reader=SafeFileSystemReader(str(path)),
                     planner=_RegionLoadPlanner(regions), no_dist=True)  # fmt: skip
