"""JSON / JSONL conversations + media files -> WebDataset tar shards (``loong-data convert-to-webdataset``).

Each input record is one conversation (see the package README for the format). A record becomes
one tar sample of key ``%08d`` (its position in the output) holding ``json`` (the record, media
references rewritten to the sample's own files, plus ``source`` = ``file:line``) and the media
bytes as stored on disk: ``img<i>.<ext>`` for the ``i``-th image, ``vid<j>.<k:03d>.<ext>`` for frame
``k`` of the ``j``-th video. ``manifest.json`` lists the shards and their sample counts.
"""

import hashlib
import io
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from loong_data.errors import DataError
from loong_data.log import logger
from loong_data.multimodal.chat import ConversationError, _check_messages

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "loong-webdataset"
MANIFEST_VERSION = 1
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
VIDEO_FILE_SUFFIXES = (".mp4", ".avi", ".mov", ".mkv", ".webm")
ON_ERROR = ("skip", "stop")


class ConvertError(DataError):
    """A bad input record (with ``--on-error stop``) or bad arguments."""


@dataclass
class ConvertReport:
    """What :func:`convert_to_webdataset` wrote and what it skipped."""

    out_dir: Path
    shards: list[Path] = field(default_factory=list)
    num_samples: int = 0
    num_skipped: int = 0
    errors: list[str] = field(default_factory=list)  # "file:line: reason", one per skipped record
    counts: dict[str, int] = field(default_factory=dict)  # samples per kind (text, image, multi-image, ...)


def _records(path: Path) -> Iterator[tuple[str, object]]:
    """``(location, record or exception)`` of a .jsonl (one per line) or .json (a list) file."""
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{n}", json.loads(line)
                except json.JSONDecodeError as e:
                    yield f"{path}:{n}", ConvertError(f"not valid JSON ({e.msg} at column {e.colno})")
    elif path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            yield f"{path}:{e.lineno}", ConvertError(f"not valid JSON ({e.msg})")
            return
        if not isinstance(data, list):
            yield f"{path}:1", ConvertError("a .json input must hold a list of records")
            return
        # json does not keep line numbers; name the record by its index instead.
        for i, record in enumerate(data):
            yield f"{path}[{i}]", record
    else:
        raise ConvertError(f"{path}: expected a .json or .jsonl file")


def _read_image(path: Path) -> bytes:
    if not path.is_file():
        raise ConvertError(f"media file not found: {path}")
    data = path.read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # a full decode: verify() alone misses truncated pixel data
            image.convert("RGB")
    except Exception as e:
        raise ConvertError(f"cannot decode image {path}: {e}") from e
    return data


def _video_frames(spec: object, root: Path) -> list[Path]:
    if isinstance(spec, list):
        if not spec or not all(isinstance(p, str) for p in spec):
            raise ConvertError("a video given as a list must be a non-empty list of frame paths")
        return [root / p for p in spec]
    if not isinstance(spec, str):
        raise ConvertError(f"a video must be a folder of frames or a list of frame paths, got {spec!r}")
    path = root / spec
    if path.is_dir():
        frames = sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
        if not frames:
            raise ConvertError(f"video folder {path} holds no image frames ({', '.join(FRAME_SUFFIXES)})")
        return frames
    if path.suffix.lower() in VIDEO_FILE_SUFFIXES:
        raise ConvertError(
            f"{path}: video files need a decoder, and none is supported; give the video as a "
            "folder of frames or a list of frame paths"
        )
    raise ConvertError(f"video not found: {path} (expected a folder of frames)")


def _kind(images: int, videos: int) -> str:
    if videos and images:
        return "mixed"
    if videos:
        return "video"
    return {0: "text", 1: "image"}.get(images, "multi-image")


def _sample(record: object, root: Path, location: str) -> tuple[dict, str]:
    """The tar sample of one record (raises ConvertError / ConversationError)."""
    if not isinstance(record, dict) or "messages" not in record:
        raise ConvertError("expected an object with a 'messages' list")
    messages = record["messages"]
    _check_messages(messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise ConvertError("no assistant turn (nothing to learn from)")
    files: dict[str, bytes] = {}
    out_messages = []
    images = videos = 0
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            items = []
            for item in content:
                item = dict(item)
                if item["type"] == "image":
                    if not isinstance(item["image"], str):
                        raise ConvertError(f"image reference must be a path, got {item['image']!r}")
                    path = root / item["image"]
                    name = f"img{images}{path.suffix.lower()}"
                    files[name] = _read_image(path)
                    item["image"] = name
                    images += 1
                elif item["type"] == "video":
                    names = []
                    for k, frame in enumerate(_video_frames(item["video"], root)):
                        name = f"vid{videos}.{k:03d}{frame.suffix.lower()}"
                        files[name] = _read_image(frame)
                        names.append(name)
                    item["video"] = names
                    videos += 1
                items.append(item)
            message = {**message, "content": items}
        out_messages.append(message)
    meta = {k: v for k, v in record.items() if k != "messages"}
    sample = {
        "json": json.dumps({**meta, "messages": out_messages, "source": location}, ensure_ascii=False).encode(
            "utf-8"
        )
    }
    sample.update(files)
    return sample, _kind(images, videos)


def convert_to_webdataset(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    *,
    media_root: str | Path | None = None,
    maxcount: int = 1000,
    maxsize: int = 1 << 30,
    on_error: str = "skip",
    overwrite: bool = False,
    progress: bool = True,
    fingerprint: str | None = None,
) -> ConvertReport:
    """Write the conversations of ``inputs`` (.json / .jsonl files) to ``out_dir/shard-%06d.tar``.

    Media paths are relative to ``media_root`` (default: each input file's folder). A shard holds at
    most ``maxcount`` samples and ``maxsize`` bytes of tar file (one larger sample gets its own). Every image
    and video frame is decoded once to check it. A bad record (bad JSON, wrong structure, missing
    or undecodable media) is skipped and reported as ``file:line: reason`` when ``on_error`` is
    ``"skip"``; with ``"stop"`` it raises :class:`ConvertError` and nothing is written. Output goes
    to a temporary folder renamed to ``out_dir`` at the end, so ``out_dir`` is complete or absent.
    ``fingerprint`` (any string) is stored in ``manifest.json`` for callers that reuse shards.
    """
    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"input not found: {path}")
        if path.suffix not in (".json", ".jsonl"):
            raise ConvertError(f"{path}: expected a .json or .jsonl file")
    records = (
        (location, record, Path(media_root) if media_root is not None else path.parent)
        for path in paths
        for location, record in _records(path)
    )
    return write_webdataset(records, out_dir, inputs=paths, maxcount=maxcount, maxsize=maxsize, on_error=on_error,
                            overwrite=overwrite, progress=progress, fingerprint=fingerprint)  # fmt: skip


def write_webdataset(
    records: Iterable[tuple[str, object, Path]],
    out_dir: str | Path,
    *,
    inputs: Sequence[str | Path] = (),
    maxcount: int = 1000,
    maxsize: int = 1 << 30,
    on_error: str = "skip",
    overwrite: bool = False,
    progress: bool = True,
    fingerprint: str | None = None,
) -> ConvertReport:
    """:func:`convert_to_webdataset` of records already read: ``(location, record, media root)``
    each, ``location`` (``file:line``) being what errors and the samples' ``source`` name, so that
    a caller that reorders or merges files still reports the user's own file and line."""
    import webdataset as wds

    if on_error not in ON_ERROR:
        raise ConvertError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    if maxcount < 1 or maxsize < 1:
        raise ConvertError("maxcount and maxsize must be positive")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConvertError(f"output folder {out_dir} exists and is not empty (pass overwrite to replace it)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.{os.getpid()}.partial"
    shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier run of this process id that was killed
    tmp.mkdir()
    report = ConvertReport(out_dir=out_dir)
    try:
        # Shards are rolled here rather than by ShardWriter, whose maxsize counts file contents
        # without tar headers and padding; mtime is fixed so that the same input gives the same bytes.
        with wds.ShardWriter(
            str(tmp / "shard-%06d.tar"), maxcount=1 << 62, maxsize=1 << 62, verbose=0, mtime=0
        ) as sink:
            bar = tqdm(desc="convert-to-webdataset", unit=" records", disable=not progress)
            shard_count = shard_bytes = 0
            for location, record, root in records:
                bar.update(1)
                try:
                    if isinstance(record, Exception):
                        raise record
                    sample, kind = _sample(record, root, location)
                except (ConvertError, ConversationError) as e:
                    message = f"{location}: {e}"
                    if on_error == "stop":
                        raise ConvertError(message) from e
                    logger.warning("skipped %s", message)
                    report.errors.append(message)
                    report.num_skipped += 1
                    continue
                sample["__key__"] = f"{report.num_samples:08d}"
                size = _tar_bytes(sample)
                if shard_count and (shard_count >= maxcount or _tar_file_bytes(shard_bytes + size) > maxsize):
                    sink.next_stream()
                    shard_count = shard_bytes = 0
                sink.write(sample)
                shard_count += 1
                shard_bytes += size
                report.num_samples += 1
                report.counts[kind] = report.counts.get(kind, 0) + 1
            bar.close()
        shards = sorted(tmp.glob("shard-*.tar"))
        _write_manifest(tmp, shards, report, [Path(p) for p in inputs], fingerprint)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.shards = [out_dir / s.name for s in shards]
    return report


def _tar_bytes(sample: dict) -> int:
    """Bytes the sample's members take in a tar: a 512-byte header each, contents padded to 512."""
    return sum(512 + -(-len(v) // 512) * 512 for k, v in sample.items() if not k.startswith("__"))


def _tar_file_bytes(member_bytes: int) -> int:
    """Size of a tar file with these members: two zero blocks at the end, padded to 10240-byte records."""
    return -(-(member_bytes + 1024) // 10240) * 10240


def _write_manifest(
    folder: Path, shards: list[Path], report: ConvertReport, inputs: list[Path], fingerprint: str | None
) -> None:
    import tarfile

    entries = []
    for shard in shards:
        with tarfile.open(shard) as tar:
            n = sum(1 for member in tar.getmembers() if member.name.endswith(".json"))
        entries.append({"name": shard.name, "num_samples": n})
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "num_samples": report.num_samples,
        "num_skipped": report.num_skipped,
        "counts": report.counts,
        "shards": entries,
        "inputs": [str(p) for p in inputs],
        "fingerprint": fingerprint,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def bundled_multimodal_shards(out_dir: str | Path, *, maxcount: int = 64, progress: bool = False) -> Path:
    """``out_dir`` holding the bundled multimodal sample as shards, converted on first use and reused
    while the bundled files and ``maxcount`` are unchanged (a fingerprint in ``manifest.json``).
    Under torch.distributed let one rank call it first (then a barrier): conversion is atomic,
    but concurrent conversions would do the work twice."""
    from loong_data.bundled import default_multimodal_dataset

    source = default_multimodal_dataset()
    digest = hashlib.sha256(f"maxcount={maxcount}".encode())
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes())
    fingerprint = digest.hexdigest()
    out_dir = Path(out_dir)
    manifest = out_dir / MANIFEST
    if manifest.is_file():
        existing = json.loads(manifest.read_text(encoding="utf-8"))
        if existing.get("fingerprint") == fingerprint and all(
            (out_dir / s["name"]).is_file() for s in existing["shards"]
        ):
            return out_dir
    convert_to_webdataset(
        [source / "conversations.jsonl"],
        out_dir,
        maxcount=maxcount,
        on_error="stop",
        overwrite=True,
        progress=progress,
        fingerprint=fingerprint,
    )
    return out_dir
