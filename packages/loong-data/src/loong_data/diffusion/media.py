"""Captioned media for diffusion training: the bundled real set (loong-data's scikit-image photos
with their docstring captions and scikit-learn digits with templated captions, as 1-frame videos,
and the pans over the photos as short clips) or a user's JSONL (``{"media": path or [frame
paths], "caption": text}``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from loong_data.bundled import default_multimodal_dataset


@dataclass(frozen=True)
class CaptionedMedia:
    id: str
    frames: tuple[Path, ...]  # one for an image
    caption: str


def _answer(record: dict) -> str:
    return record["messages"][1]["content"][0]["text"]


def _media(record: dict) -> str:
    part = next(c for c in record["messages"][0]["content"] if c["type"] in ("image", "video"))
    return part[part["type"]]


def bundled_captioned_media(root: Path | None = None, *, clips: bool = True) -> list[CaptionedMedia]:
    """17 photos + 200 digits (1 frame each) and, with ``clips``, 6 eight-frame pans."""
    root = root or default_multimodal_dataset()
    records = [json.loads(line) for line in (root / "conversations.jsonl").read_text().splitlines()]
    captions = {}
    out = []
    for r in records:
        if r["id"].startswith("caption-"):
            captions[_media(r)] = _answer(r)
            out.append(CaptionedMedia(r["id"].removeprefix("caption-"), (root / _media(r),), _answer(r)))
        elif r["id"].removeprefix("digit-").isdigit():  # one digit image and its label
            out.append(CaptionedMedia(r["id"], (root / _media(r),), f"A handwritten digit {_answer(r)}."))
    if clips:
        for r in records:
            if r["id"].startswith("video-pan-"):
                photo = f"images/{r['id'].removeprefix('video-pan-')}.jpg"
                frames = tuple(sorted((root / _media(r)).glob("*.jpg")))
                text = f"{captions[photo]} The view moves {_answer(r)[0].lower()}{_answer(r)[1:]}"
                out.append(CaptionedMedia(r["id"], frames, text))
    return out


def jsonl_captioned_media(path: Path) -> list[CaptionedMedia]:
    """A user's captioned media: one JSON object per line, media paths relative to the file."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            media, caption = r["media"], r["caption"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: expected {{\"media\": path or [paths], \"caption\": text}} ({e})") from None
        frames = tuple(path.parent / m for m in ([media] if isinstance(media, str) else media))
        if missing := [str(f) for f in frames if not f.is_file()]:
            raise ValueError(f"{path}:{n}: media file {missing[0]} does not exist")
        out.append(CaptionedMedia(r.get("id", f"{path.stem}-{n}"), frames, caption))
    return out
