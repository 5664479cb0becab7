"""JSONL conversations + media (default: the bundled real images with captions and questions)
become WebDataset shards once, in ``data.cache_dir``, in a seeded record order, so the held-out
last shard(s) are a random sample of the data. A fingerprint of the JSONL contents, media roots
and conversion settings names the folder."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from loong_data.bundled import default_multimodal_dataset
from loong_data.log import logger
from loong_data.multimodal.convert import ConvertError, write_webdataset
from loong_data.prepare import sha256_file
from loong_data.step_data.config import MultimodalDataConfig
from loong_data.step_data.layout import DataError

CONVERTED_VERSION = 1  # bump when the conversion below changes what it writes


def _read_records(sources: list[Path], roots: list[Path]) -> list[tuple[str, object, Path]]:
    """``(the user's file:line, record, media root)`` of every line: a skipped record is reported
    by the user's own file and line, whatever the seeded order puts it."""
    records = []
    for src, root in zip(sources, roots):
        with src.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append((f"{src}:{n}", json.loads(line), root))
                except json.JSONDecodeError as e:
                    raise DataError(f"data.multimodal.jsonl: {src}:{n} is not valid JSON ({e.msg})") from None
    return records


def convert_sources(mm: MultimodalDataConfig, cache_dir: str | Path, seed: int) -> Path:
    """Shards of the JSONL sources (bundled set when none) in ``cache_dir``, converted once.
    Media files are not hashed: edit one in place and delete the folder to convert again."""
    sources = [Path(p) for p in mm.jsonl] or [default_multimodal_dataset() / "conversations.jsonl"]
    for src in sources:
        if not src.is_file():
            raise DataError(f"data.multimodal.jsonl: {src} not found")
    roots = [Path(mm.media_root) if mm.media_root else src.parent for src in sources]
    key = {"version": CONVERTED_VERSION, "sources": [sha256_file(s) for s in sources],
           "roots": [str(r.resolve()) for r in roots], "per_shard": mm.samples_per_shard, "seed": seed}  # fmt: skip
    fp = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(cache_dir) / f"multimodal-{fp}"
    if (out / "manifest.json").is_file():
        logger.info("multimodal shards: %s (cached)", out)
        return out
    records = _read_records(sources, roots)
    random.Random(seed).shuffle(records)
    try:  # written atomically: out is complete or absent
        report = write_webdataset(records, out, inputs=sources, maxcount=mm.samples_per_shard, overwrite=True)
    except ConvertError as e:
        raise DataError(f"data.multimodal.jsonl: {e}") from None
    if report.num_skipped:
        logger.warning("skipped %d bad records while converting, e.g. %s", report.num_skipped, report.errors[0])
    logger.info("converted %d conversations into %d shards: %s", report.num_samples, len(report.shards), out)
    return out
