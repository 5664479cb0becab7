"""The tokenised file format and its memory-mapped reader.

A split is two files sharing a prefix:

- ``<prefix>.bin``: the token ids of all documents back to back (each ending with EOD), raw
  little-endian ``uint16`` (vocab < 65536) or ``uint32``;
- ``<prefix>.idx.json``: ``{"format", "version", "dtype", "num_tokens", "doc_offsets",
  "fingerprint", ...}``; ``doc_offsets`` has one entry per document plus the end, so document
  ``d`` is ``tokens[doc_offsets[d]:doc_offsets[d + 1]]``.

The index is written last, so its presence marks a complete ``.bin``.
"""

import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import numpy as np

FORMAT = "loong-tokens"
VERSION = 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
BIN_SUFFIX = ".bin"
IDX_SUFFIX = ".idx.json"


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size < 2**16 else "uint32"


def split_paths(path_prefix: str | Path) -> tuple[Path, Path]:
    """``(bin, idx)`` paths of a prefix; a path already ending in .bin or .idx.json is accepted too."""
    prefix = str(path_prefix)
    for suffix in (BIN_SUFFIX, IDX_SUFFIX):
        prefix = prefix.removesuffix(suffix)
    return Path(prefix + BIN_SUFFIX), Path(prefix + IDX_SUFFIX)


def _temp_path(path: Path) -> Path:
    # A hidden sibling (same filesystem, so os.replace is atomic), created with open(..., "x")
    # rather than mkstemp so that the final file gets the usual umask permissions, not 0600.
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = _temp_path(path)
    try:
        with tmp.open("x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class TokenWriter:
    """Writes one split: tokens go to a hidden temp file; :meth:`commit` renames it to
    ``<prefix>.bin`` and then writes ``<prefix>.idx.json``. Leaving the ``with`` block through an
    exception deletes the temp file, so an interrupted write never produces an index."""

    def __init__(self, path_prefix: str | Path, dtype: str) -> None:
        self.bin_path, self.idx_path = split_paths(path_prefix)
        self.dtype = dtype
        self._np_dtype = DTYPES[dtype]
        self.doc_offsets = [0]
        self._tmp = _temp_path(self.bin_path)
        self._file = self._tmp.open("xb")

    @property
    def num_tokens(self) -> int:
        return self.doc_offsets[-1]

    def add(self, ids: Sequence[int]) -> None:
        """Append one document's ids (the caller has already appended EOD)."""
        arr = np.asarray(ids, dtype=np.int64)
        # Guard the narrowing cast: an id that does not fit would silently wrap around.
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self._np_dtype).max):
            raise ValueError(f"token id out of range for {self.dtype} in {self.bin_path}")
        arr.astype(self._np_dtype).tofile(self._file)
        self.doc_offsets.append(self.num_tokens + arr.size)

    def commit(self, meta: dict[str, Any]) -> None:
        """Publish the .bin, then the index (``meta`` plus format, version, dtype, sizes, offsets)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.bin_path)
        index = {**meta, "format": FORMAT, "version": VERSION, "dtype": self.dtype,
                 "num_tokens": self.num_tokens, "num_docs": len(self.doc_offsets) - 1,
                 "doc_offsets": self.doc_offsets}
        _atomic_write_text(self.idx_path, json.dumps(index))

    def abort(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()


def read_index(idx_path: Path) -> dict[str, Any]:
    """Parse and check an index file; errors name the file and what was expected."""
    if not idx_path.is_file():
        raise FileNotFoundError(f"token index not found: {idx_path} (expected the {IDX_SUFFIX} written "
                                "by prepare_text_dataset next to its .bin)")
    try:
        meta = json.loads(idx_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"token index {idx_path} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"token index {idx_path}: expected a JSON object with format {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise ValueError(f"token index {idx_path}: unknown version {meta.get('version')!r} "
                         f"(this loong-data reads version {VERSION}; re-run prepare_text_dataset)")
    if meta.get("dtype") not in DTYPES:
        raise ValueError(f"token index {idx_path}: dtype {meta.get('dtype')!r}, expected one of {sorted(DTYPES)}")
    num_tokens, offsets = meta.get("num_tokens"), meta.get("doc_offsets")
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"token index {idx_path}: num_tokens {num_tokens!r}, expected an integer >= 0")
    if (not isinstance(offsets, list) or not offsets or offsets[0] != 0 or offsets[-1] != num_tokens
            or any(not isinstance(o, int) for o in offsets) or np.any(np.diff(offsets) < 0)):
        raise ValueError(f"token index {idx_path}: doc_offsets must be non-decreasing integers "
                         f"from 0 to num_tokens ({num_tokens})")
    return meta


def too_short(token_file: "TokenFile", need: str) -> str:
    """The message for a split too small to sample from, naming the user's sources (from the index)
    rather than the cache file when the index records them."""
    split = token_file.meta.get("split", "")
    sources = ", ".join(token_file.meta.get("sources") or [str(token_file.bin_path)])
    return (f"{sources}: the {split} split has {token_file.num_tokens} tokens, too few: {need} "
            "(give more text, a shorter sequence length or another val_fraction)")


class TokenFile:
    """Read-only, memory-mapped view of one tokenised split (``<prefix>.bin`` + ``<prefix>.idx.json``).

    Attributes: ``tokens`` (numpy memmap of ``num_tokens`` ids), ``num_tokens``, ``doc_offsets``
    (int64 array, ``num_docs + 1`` entries), ``num_docs``, ``dtype``, ``fingerprint``, ``meta``
    (the whole index). Construction validates the index against the .bin and raises
    FileNotFoundError / ValueError naming the file.
    """

    def __init__(self, path_prefix: str | Path) -> None:
        self.bin_path, self.idx_path = split_paths(path_prefix)
        self.meta = read_index(self.idx_path)
        self.dtype: str = self.meta["dtype"]
        self.num_tokens: int = self.meta["num_tokens"]
        self.fingerprint: str | None = self.meta.get("fingerprint")
        self.doc_offsets = np.asarray(self.meta["doc_offsets"], dtype=np.int64)
        self.tokens = self._map()

    def _map(self) -> np.ndarray:
        if not self.bin_path.is_file():
            raise FileNotFoundError(f"token file not found: {self.bin_path} (its index {self.idx_path} exists)")
        dtype = DTYPES[self.dtype]
        expected = self.num_tokens * dtype.itemsize
        size = self.bin_path.stat().st_size
        if size != expected:
            raise ValueError(f"token file {self.bin_path} has {size} bytes, expected {expected} "
                             f"({self.num_tokens} {self.dtype} tokens per {self.idx_path}); "
                             "it is truncated or does not belong to this index")
        if self.num_tokens == 0:  # mmap cannot map an empty file
            return np.empty(0, dtype=dtype)
        return np.memmap(self.bin_path, dtype=dtype, mode="r", shape=(self.num_tokens,))

    @property
    def num_docs(self) -> int:
        return len(self.doc_offsets) - 1

    def __len__(self) -> int:
        return self.num_tokens

    # Pickling (DataLoader workers under spawn) must not copy the mapped tokens: reopen instead.
    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "tokens"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.tokens = self._map()

    def __repr__(self) -> str:
        return f"TokenFile({str(self.bin_path)!r}, num_tokens={self.num_tokens}, num_docs={self.num_docs})"
