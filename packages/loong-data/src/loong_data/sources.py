"""Text sources: resolve folders / file lists and read documents from ``.txt`` and ``.jsonl`` files.

A ``.txt`` file is one document; each non-blank line of a ``.jsonl`` file is one document, its
``"text"`` field.
"""

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from loong_data.errors import DataError

SUFFIXES = (".txt", ".jsonl")

Sources = str | Path | Sequence[str | Path]


@dataclass(frozen=True)
class Document:
    where: str  # "file" or "file:line", for error messages
    text: object  # checked by the consumer, so that a bad value fails where it is written


def resolve_sources(sources: Sources) -> list[Path]:
    """The source files in reading order: a folder's ``.txt``/``.jsonl`` files sorted by name,
    or the given files in the given order."""
    items = [sources] if isinstance(sources, str | Path) else list(sources)
    if not items:
        raise ValueError("no sources given (expected a folder, or .txt / .jsonl files)")
    files: list[Path] = []
    for item in map(Path, items):
        if item.is_dir():
            found = sorted(p for p in item.iterdir() if p.suffix in SUFFIXES and p.is_file())
            if not found:
                raise FileNotFoundError(f"no .txt or .jsonl files in folder {item}")
            files.extend(found)
        elif item.is_file():
            if item.suffix not in SUFFIXES:
                raise DataError(f"unsupported source {item}: expected a .txt or .jsonl file")
            files.append(item)
        else:
            raise FileNotFoundError(f"source not found: {item} (expected a folder, or a .txt / .jsonl file)")
    return files


def _text(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                        "data sources must be .txt / .jsonl text files") from None


def _jsonl_lines(file: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of the non-blank lines; a line that is not UTF-8 fails naming it."""
    with file.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = _text(raw, f"{file}:{lineno}")
            if line.strip():
                yield lineno, line


def count_documents(files: list[Path]) -> int:
    """Number of documents without parsing JSON: one per .txt file, one per non-blank .jsonl line."""
    return sum(sum(1 for _ in _jsonl_lines(f)) if f.suffix == ".jsonl" else 1 for f in files)


def iter_documents(files: list[Path]) -> Iterator[Document]:
    """Documents in order. Raises DataError naming the file (and line) of a file that is not UTF-8
    text or of a malformed JSONL record."""
    for file in files:
        if file.suffix != ".jsonl":
            yield Document(str(file), _text(file.read_bytes(), str(file)))
            continue
        for lineno, line in _jsonl_lines(file):
            where = f"{file}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict) or "text" not in record:
                raise DataError(f'{where}: expected a JSON object with a "text" field')
            yield Document(where, record["text"])
