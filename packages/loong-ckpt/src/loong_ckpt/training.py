"""Training checkpoints: megatron distributed checkpoints, written atomically.

Layout under a run's checkpoint root::

    step_00000100/            a complete checkpoint (megatron dist-checkpoint + loong.json)
    step_00000200.partial/    being written, or left by a crash: never loaded, removed on next save
    step_00000300.corrupt/    failed its integrity check on resume: set aside, never loaded or deleted
    latest                    text file naming the newest complete checkpoint

A checkpoint directory only gets its final name after every rank has finished writing and the
metadata file, which holds a SHA-256 of every other file (integrity.py), is on disk, so a crash
mid-save can never leave one that looks complete, and bytes changed later are found before they
are loaded. Loading runs no code from the files (safe_load.py). Because
megatron checkpoints are sharded by parameter, not by rank, a checkpoint saved with one TP / PP / DP
layout loads into another.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loong_ckpt.class_names import classes_in, classes_to_names, names_to_classes
from loong_ckpt.integrity import IntegrityError, check_files, hash_files, listed_files
from loong_ckpt.log import logger
from loong_ckpt.safe_load import SafeFileSystemReader, vet_checkpoint

META_FILE = "loong.json"
LATEST_FILE = "latest"
PARTIAL_SUFFIX = ".partial"
CORRUPT_SUFFIX = ".corrupt"
FORMAT_VERSION = 2  # 2: loong.json lists every file's SHA-256 ("files")
_READABLE_VERSIONS = (1, 2)  # 1: no hashes; loaded with a warning
_COMPLETE = re.compile(r"step_\d{8}")
# The distributed optimizer's state is saved per parameter, like the model ("fully_reshardable"),
# so a run can resume under another TP / PP / DP layout; megatron's default format for it
# ("fully_sharded_model_space") is deprecated and rejected by its own checkpoint validation.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    meta: dict[str, Any]


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _gather(local: Any) -> list[Any]:
    """Every rank's ``local`` (a picklable value), on every rank."""
    if not dist.is_initialized():
        return [local]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, local)
    return out


def read_checkpoint_info(path: str | Path) -> CheckpointInfo:
    """Metadata of a complete checkpoint directory; a clear error for anything else."""
    path = Path(path)
    meta_path = path / META_FILE
    if path.name.endswith(PARTIAL_SUFFIX):
        raise ValueError(f"{path} is an incomplete checkpoint (interrupted save); it cannot be loaded")
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path} is not a complete Loong checkpoint: {META_FILE} is missing")
    try:
        meta = json.loads(meta_path.read_text())
        step = int(meta["step"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_path}: not readable checkpoint metadata ({type(e).__name__}: {e})") from None
    if meta.get("format_version") not in _READABLE_VERSIONS:
        raise ValueError(
            f"{meta_path}: format_version={meta.get('format_version')}, expected {FORMAT_VERSION}"
        )
    return CheckpointInfo(path, step, meta)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories by name (not .partial / .corrupt), oldest first."""
    return sorted(d for d in root.glob("step_*") if _COMPLETE.fullmatch(d.name) and d.is_dir())


def latest_checkpoint(root: str | Path) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``root``, or None when there is none (no integrity
    check: :func:`newest_verified_checkpoint` for resuming)."""
    root = Path(root)
    latest = root / LATEST_FILE
    if latest.is_file():
        candidate = root / latest.read_text().strip()
        try:
            return read_checkpoint_info(candidate)
        except (FileNotFoundError, ValueError) as e:
            logger.warning("%s points at an unusable checkpoint (%s); scanning %s", latest, e, root)
    for d in reversed(complete_checkpoints(root)):
        if (d / META_FILE).is_file():
            try:
                return read_checkpoint_info(d)
            except ValueError as e:
                logger.warning("skipping %s: %s", d, e)
    return None


def verify_checkpoint(info: CheckpointInfo) -> None:
    """Collective: the ranks split the checkpoint's files and compare each with the SHA-256 that
    ``loong.json`` records; :class:`IntegrityError` names every file that differs."""
    files = info.meta.get("files")
    if files is None:
        if _is_main():
            logger.warning("%s has no file hashes (format_version %s): loading it unverified",
                           info.path, info.meta.get("format_version"))  # fmt: skip
        return
    rank, world = _rank_world()
    problems = [p for local in _gather(check_files(info.path, files, rank=rank, world=world)) for p in local]
    if problems:
        raise IntegrityError(f"{info.path} failed its integrity check: {'; '.join(problems)}")


def newest_verified_checkpoint(root: str | Path) -> CheckpointInfo | None:
    """Collective: the newest complete checkpoint under ``root`` whose files match their hashes.
    Newer ones that fail are renamed ``<name>.corrupt`` (never loaded, never deleted by retention)
    and the fallback is logged. None when ``root`` holds no complete checkpoint; an
    :class:`IntegrityError` when it holds some but none verifies."""
    root = Path(root)
    failed = []
    for d in reversed(complete_checkpoints(root)):
        if not (d / META_FILE).is_file():
            continue  # not a checkpoint (never one of ours: a save names its directory last)
        try:
            info = read_checkpoint_info(d)
            verify_checkpoint(info)
        except ValueError as e:  # IntegrityError is a ValueError
            failed.append(f"{d.name}: {e}")
            _set_aside(d, e)
            continue
        if failed and _is_main():
            logger.warning("resuming from %s, the newest checkpoint that verifies", info.path)
        return info
    if failed:
        raise IntegrityError(f"no checkpoint under {root} verifies: {' | '.join(failed)}")
    return None


def _set_aside(path: Path, reason: Exception) -> None:
    _barrier()  # every rank has finished reading it
    if _is_main():
        target = path.with_name(path.name + CORRUPT_SUFFIX)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(path, target)
        logger.warning("checkpoint %s is unusable (%s); moved it to %s", path, reason, target)
    _barrier()


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as mpu

    layout = dict(
        tp=mpu.get_tensor_model_parallel_world_size(),
        pp=mpu.get_pipeline_model_parallel_world_size(),
        dp=mpu.get_data_parallel_world_size(),
    )
    cp = mpu.get_context_parallel_world_size()
    return {**layout, "cp": cp} if cp > 1 else layout  # "cp" only with CP: older checkpoints match


def _rng_object(state: Any):
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    lay = _layout()
    shape = (lay["pp"], lay["tp"], lay["dp"])
    offset = (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank(),
              mpu.get_data_parallel_rank())  # fmt: skip
    if "cp" in lay:  # every CP rank of a DP rank keeps its own state (else: duplicate keys)
        shape, offset = (*shape, lay["cp"]), (*offset, mpu.get_context_parallel_rank())
    return ShardedObject("rng_state", state, shape, offset, replica_id=0)


def _fork_writer_queue() -> None:
    """megatron's checkpoint writers report through a multiprocessing Manager queue that it
    creates once per process with the 'spawn' method, which re-imports torch in a fresh
    interpreter (5-15 s on a small host). A forked manager is ready in milliseconds. The manager
    is a process of its own: it is told to die with this one, or a trainer killed with SIGKILL
    would leave it running (with its copy of the trainer's memory) forever."""
    from multiprocessing import util

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    hook = _DieWithParent(os.getpid())
    util.register_after_fork(hook, _DieWithParent.arm)  # runs in children that multiprocessing starts
    try:
        filesystem_async.get_write_results_queue(mp_mode="fork")
    finally:
        del hook  # the registry holds it weakly: later children are not touched


class _DieWithParent:
    """In a child process: have the kernel send SIGKILL when the parent exits (Linux prctl
    PR_SET_PDEATHSIG; elsewhere nothing). The signal follows the parent *thread* that forked the
    child, so children must be started from the thread that lives as long as the process."""

    _PR_SET_PDEATHSIG = 1

    def __init__(self, parent: int) -> None:
        self.parent = parent

    def arm(self) -> None:
        import ctypes
        import signal
        import sys

        if not sys.platform.startswith("linux"):
            return
        ctypes.CDLL(None, use_errno=True).prctl(self._PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != self.parent:  # the parent died before the signal was armed
            os._exit(1)


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / Float16Module wrappers: checkpoints are keyed by the model's own
    parameter names, whatever wrapped it for training."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


# Which model tensors a checkpoint holds / a load reads: every tensor, only the trainable
# parameters (LoRA: the adapters; the frozen base comes from train.init_from), or the rest.
PARTS = ("all", "trainable", "frozen")


def _select(model: torch.nn.Module, part: str) -> dict[str, Any]:
    sd = model.sharded_state_dict()
    if part == "all":
        return sd
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in sd.items() if (k in trainable) == (part == "trainable")}


def _model_sharded_state_dict(chunks: list[torch.nn.Module], part: str = "all") -> dict[str, Any]:
    if part not in PARTS:
        raise ValueError(f"checkpoint part {part!r}; allowed: {', '.join(PARTS)}")
    if len(chunks) == 1:
        return {"model": _select(_unwrap(chunks[0]), part)}
    return {f"model{i}": _select(_unwrap(c), part) for i, c in enumerate(chunks)}


def save_checkpoint(
    root: str | Path,
    step: int,
    chunks: list[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    *,
    rng_state: Any = None,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    trainable_only: bool = False,
) -> Path:
    """Save model chunks (+ optimizer, scheduler, per-rank RNG state) for ``step``; collective.
    ``trainable_only``: only parameters with ``requires_grad`` (e.g. LoRA adapters; the caller
    records in ``extra`` where the frozen rest comes from)."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final, partial = _step_dir(root, step), root / (_step_dir(root, step).name + PARTIAL_SUFFIX)
    if _is_main():
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"step_*{PARTIAL_SUFFIX}"):
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir()
    _barrier()
    t0 = time.perf_counter()
    part = "trainable" if trainable_only else "all"
    state = _model_sharded_state_dict(chunks, part)
    if optimizer is not None:
        model_sd = dict(state)
        # classes in param groups (host-offloaded optimizer) are saved as names: the loader's
        # weights-only unpickler refuses classes
        state["optimizer"] = classes_to_names(optimizer.sharded_state_dict(
            model_sd if len(chunks) > 1 else model_sd["model"], metadata=OPTIMIZER_METADATA
        ))
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if rng_state is not None:
        state["rng_state"] = _rng_object(rng_state)
    _fork_writer_queue()
    dist_checkpointing.save(state, str(partial))
    _barrier()
    files = _hash_written(partial)
    if _is_main():
        meta = {"format_version": FORMAT_VERSION, "step": step, "layout": _layout(), "time": time.time(),
                "params": part}  # fmt: skip
        meta.update(extra or {})
        meta["files"] = files
        _write_atomic(partial / META_FILE, json.dumps(meta, indent=2))
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(partial, final)
        _write_atomic(root / LATEST_FILE, final.name)
        if keep_last:
            retain(root, keep_last, verified=final)
        logger.info("saved checkpoint %s in %.1fs", final, time.perf_counter() - t0)
    _barrier()
    return final


def _hash_written(path: Path) -> dict[str, dict]:
    """Collective: the SHA-256 of every file just written under ``path``, the ranks splitting the
    files (read back from disk: the hashes describe what is stored, not what was meant)."""
    rank, world = _rank_world()
    names = _gather(listed_files(path, META_FILE) if rank == 0 else None)[0]
    return {k: v for part in _gather(hash_files(path, names, rank=rank, world=world)) for k, v in part.items()}


def retain(root: Path, keep_last: int, *, verified: Path) -> list[Path]:
    """Delete complete checkpoints older than the newest ``keep_last``, except ``verified`` (the
    newest one known to match its hashes), which is never deleted. Returns what was deleted."""
    gone = [d for d in complete_checkpoints(root)[:-keep_last] if d.resolve() != verified.resolve()]
    for old in gone:
        shutil.rmtree(old, ignore_errors=True)
    return gone


_EXTRA_STATE = "_extra_state"


def _use_stored_names(template: dict[str, Any], stored: dict[str, Any]) -> int:
    """Where megatron's local and TE specs give a tensor different keys (MLA's latent norms, the
    pre-MLP norm of MoE layers: the mapping's rule aliases), load it under the name the checkpoint
    has, so a checkpoint written with one spec (``loong-convert`` builds the local one) loads into
    the other. Returns how many keys were renamed."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from loong_ckpt.families import key_aliases
    from loong_ckpt.mapping import layer_key, rule_key

    aliases = key_aliases()
    renamed = 0

    def visit(node: Any) -> None:
        nonlocal renamed
        if isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, ShardedTensor | ShardedTensorFactory) and node.key not in stored:
            name, layer = rule_key(node.key)
            for other in aliases.get(name, ()):
                candidate = other if layer is None else layer_key(other, layer)
                if candidate in stored:
                    node.key = candidate
                    renamed += 1
                    break

    visit(template)
    return renamed


def _check_shapes(template: dict[str, Any], stored: dict[str, Any], path: Path) -> None:
    """Refuse, in one line naming the tensors, a checkpoint whose tensors have other global shapes
    than the model's (another width, vocabulary or padding: e.g. a VLM checkpoint written before
    the ViT MLP was padded needs ``model.image_encoder.pad_ffn_to=1``). megatron would otherwise
    fail deep inside its load with a message that names no setting."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    wrong: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, ShardedTensor) and node.key in stored:
            saved, expected = tuple(stored[node.key].size), tuple(node.global_shape)
            if saved != expected:
                wrong[node.key] = (saved, expected)

    visit(template)
    if wrong:
        shown = "; ".join(f"{k}: {list(a)} in the checkpoint, {list(b)} in the model" for k, (a, b) in list(wrong.items())[:3])
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise CheckpointMismatchError(f"{path}: checkpoint does not match the model's shapes: {shown}{more}; build the model "
                         "with the checkpoint's settings (its loong.json holds the run's config)")  # fmt: skip


def _drop_absent_extra_state(template: dict[str, Any], path: Path) -> bool:
    """Transformer Engine modules carry an ``_extra_state`` (FP8 scaling metadata) that the local
    spec's modules do not have. A checkpoint written with one spec must load into the other (CPU
    runs use the local spec, GPU runs TE), so extra states the checkpoint lacks are left out of
    the load and start fresh. Returns whether any was left out."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # torch.distributed.checkpoint stores a sharded object as "<key>/shard_<offset>_<count>"
    present = {k.split("/")[0] for k in SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata}
    dropped = False

    def visit(node: dict) -> None:
        nonlocal dropped
        for key, value in list(node.items()):
            if isinstance(value, dict):
                visit(value)
            elif (
                isinstance(value, ShardedObject)
                and value.key.endswith(_EXTRA_STATE)
                and value.key not in present
            ):
                del node[key]
                dropped = True

    visit(template)
    return dropped


class CheckpointMismatchError(ValueError):
    """A checkpoint whose tensors are not the model's (other names or shapes): the model was built
    with other settings than the checkpoint's."""


def load_checkpoint(
    path: str | Path,
    chunks: list[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    *,
    rng_state_template: Any = None,
    part: str | None = None,
    verify: bool = True,
) -> tuple[CheckpointInfo, Any]:
    """Load into ``chunks`` (and optimizer / scheduler when given). Returns the checkpoint info
    and this rank's saved RNG state (None when not saved or the layout changed). ``part``: which
    model tensors to read (``all``, ``trainable``, ``frozen``); default: what the checkpoint holds.
    Collective. The files are checked against their hashes first (``verify=False``: the caller
    just did, e.g. :func:`newest_verified_checkpoint`), and nothing in them is run as code."""
    from megatron.core import dist_checkpointing

    from loong_ckpt.mcore_io import read_metadata

    info = read_checkpoint_info(path)
    if verify:
        verify_checkpoint(info)
    vet_checkpoint(info.path)  # before megatron unpickles anything from it
    saved = info.meta.get("params", "all")
    part = part or saved
    if saved == "trainable" and part != "trainable":
        raise ValueError(f"{info.path} holds only trainable parameters (e.g. LoRA adapters), not the "
                         f"{part} ones; load the base weights from the checkpoint it names")  # fmt: skip
    template = _model_sharded_state_dict(chunks, part)
    stored = read_metadata(info.path)  # tensor key -> global size: one read for renaming and checking
    _use_stored_names(template, stored)
    _check_shapes(template, stored, info.path)
    if optimizer is not None:
        model_sd = dict(template)
        template["optimizer"] = optimizer.sharded_state_dict(
            model_sd if len(chunks) > 1 else model_sd["model"], is_loading=True, metadata=OPTIMIZER_METADATA
        )
    same_layout = info.meta.get("layout") == _layout()
    if rng_state_template is not None and same_layout:
        template["rng_state"] = _rng_object(rng_state_template)
    absent = _drop_absent_extra_state(template, info.path)
    state = dist_checkpointing.load(template, str(info.path))
    for i, c in enumerate(chunks):
        subset = part != "all"  # the other tensors stay as they are
        sd = state["model" if len(chunks) == 1 else f"model{i}"]
        result = _unwrap(c).load_state_dict(sd, strict=not (absent or subset))
        # non-strict loads: only absent TE extra states (and, for a subset, the other part) may be missing
        missing = [] if subset else [k for k in result.missing_keys if not k.endswith(_EXTRA_STATE)]
        if missing or result.unexpected_keys:
            raise CheckpointMismatchError(f"{info.path}: checkpoint does not match the model: missing {missing}, "
                             f"unexpected {result.unexpected_keys}")  # fmt: skip
    if optimizer is not None:
        # megatron's param_groups: the inner optimizers' groups (a chained optimizer's, all of them)
        optimizer.load_state_dict(names_to_classes(state["optimizer"], classes_in(optimizer.param_groups)))
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])
    return info, state.get("rng_state")
