"""Content hashes of checkpoint files: recorded before a checkpoint is marked complete, checked
before any of it is read.

A checkpoint's ``loong.json`` lists every other file of the directory with its size and SHA-256.
Hashing streams each file in 8 MiB blocks (memory stays flat), and several processes split the
files between them (``rank`` / ``world``), so a check costs about one extra read of the
checkpoint spread over the ranks, mostly from the page cache right after a save.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

HASH = "sha256"
_BLOCK = 8 << 20


class IntegrityError(ValueError):
    """A checkpoint file is missing, truncated or has other bytes than when it was written."""


def file_digest(path: Path) -> str:
    h = hashlib.new(HASH)
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def listed_files(path: Path, skip: str) -> list[str]:
    """Every file under ``path`` (relative, sorted) except ``skip``, the metadata file that will
    hold the hashes."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != skip)


def _share(names: list[str], rank: int, world: int) -> list[str]:
    return names[rank::world]


def hash_files(path: Path, names: list[str], *, rank: int = 0, world: int = 1) -> dict[str, dict]:
    """``{name: {"bytes": size, "sha256": digest}}`` for this rank's share of ``names``."""
    return {
        n: {"bytes": (path / n).stat().st_size, HASH: file_digest(path / n)}
        for n in _share(names, rank, world)
    }


def check_files(path: Path, files: dict[str, dict], *, rank: int = 0, world: int = 1) -> list[str]:
    """Problems with this rank's share of the recorded ``files`` (empty: all match). Sizes are
    compared before any byte is hashed, so a truncated file fails at once."""
    problems = []
    for name in _share(sorted(files), rank, world):
        f, want = path / name, files[name]
        if not f.is_file():
            problems.append(f"{f}: file is missing")
        elif f.stat().st_size != want["bytes"]:
            problems.append(f"{f}: {f.stat().st_size} bytes, {want['bytes']} when written")
        elif (got := file_digest(f)) != want[HASH]:
            problems.append(f"{f}: {HASH} {got[:16]}..., {want[HASH][:16]}... when written")
    return problems
