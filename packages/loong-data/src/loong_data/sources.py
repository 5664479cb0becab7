"""Text sources: resolve folders / file lists and read documents from ``.txt`` and ``.jsonl`` files.

A ``.txt`` file is one document; each non-blank line of a ``.jsonl`` file is one document, its
``"text"`` field.
"""

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

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
                raise ValueError(f"unsupported source {item}: expected a .txt or .jsonl file")
            files.append(item)
        else:
            raise FileNotFoundError(f"source not found: {item} (expected a folder, or a .txt / .jsonl file)")
    return files


def count_documents(files: list[Path]) -> int:
    """Number of documents without parsing JSON: one per .txt file, one per non-blank .jsonl line."""
    n = 0
    for file in files:
        if file.suffix == ".jsonl":
            # Same decoding and blank-line rule as iter_documents, so the counts agree.
            with file.open(encoding="utf-8") as f:
                n += sum(1 for line in f if line.strip())
        else:
            n += 1
    return n


def iter_documents(files: list[Path]) -> Iterator[Document]:
    """Documents in order. Raises ValueError naming the file and line of a malformed JSONL record."""
    for file in files:
        if file.suffix != ".jsonl":
            yield Document(str(file), file.read_text(encoding="utf-8"))
            continue
        with file.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{file}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON ({e.msg})") from e
                if not isinstance(record, dict) or "text" not in record:
                    raise ValueError(f'{where}: expected a JSON object with a "text" field')
                yield Document(where, record["text"])
