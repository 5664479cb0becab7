"""Camera frames stored as mp4 (LeRobot feature dtype ``video``), decoded with PyAV as LeRobot does.

Where: v3.0 packs many episodes into one file per camera, ``info["video_path"]`` formatted with the
episode's ``videos/{key}/chunk_index`` / ``file_index`` (``meta/episodes``), and the episode starts
at ``videos/{key}/from_timestamp`` in it; v2.1 has one file per episode and camera starting at 0.
Which frame: the frame's ``timestamp`` (+ the episode's offset) is looked up in the stream; the
decoded frame nearest to it is taken if it lies within ``tolerance_s`` (LeRobot's default 1e-4 s),
as ``lerobot.datasets.video_utils.decode_video_frames_pyav``: seek to the keyframe at or before
the time, decode forward. Needs the ``video`` extra (``av``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from loong_data.lerobot.meta import DatasetMeta

TOLERANCE_S = 1e-4  # LeRobotDataset's default tolerance_s


@dataclass(frozen=True)
class EpisodeVideo:
    path: Path
    offset_s: float  # where the episode starts in the file


def _import_av():
    try:
        import av
    except ImportError:
        raise ImportError(
            "LeRobot cameras stored as video need PyAV: install loong-data[video] (av)"
        ) from None
    return av


def episode_videos(meta: DatasetMeta, key: str) -> dict[int, EpisodeVideo]:
    """Camera ``key``'s file and start time for every episode."""
    template = meta.info.get("video_path")
    if not template:
        raise ValueError(
            f"{meta.root}/meta/info.json: camera {key!r} is stored as video but 'video_path' is unset"
        )
    if meta.version == "v2.1":
        chunk = int(meta.info.get("chunks_size", 1000))
        return {e.index: EpisodeVideo(meta.root / template.format(episode_chunk=e.index // chunk, video_key=key,
                                                                  episode_index=e.index), 0.0)
                for e in meta.episodes}  # fmt: skip
    cols = [f"videos/{key}/{c}" for c in ("chunk_index", "file_index", "from_timestamp")]
    out = {}
    for f in sorted((meta.root / "meta" / "episodes").glob("chunk-*/file-*.parquet")):
        t = pq.read_table(f)
        missing = [c for c in cols if c not in t.column_names]
        if missing:
            raise KeyError(f"{f}: no column {missing[0]!r} (camera {key!r} is stored as video)")
        t = t.select(["episode_index", *cols]).to_pydict()
        for ep, chunk, file, start in zip(t["episode_index"], *(t[c] for c in cols)):
            path = meta.root / template.format(video_key=key, chunk_index=chunk, file_index=file)
            out[int(ep)] = EpisodeVideo(path, float(start))
    return out


def decode_frames(
    path: Path, timestamps: list[float], *, episode: int, tolerance_s: float = TOLERANCE_S
) -> np.ndarray:
    """The frames of ``path`` nearest to ``timestamps`` (seconds in the file), uint8 [N, H, W, 3];
    errors name the file and ``episode``."""
    av = _import_av()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing video (episode {episode})")
    first, last = min(timestamps), max(timestamps)
    frames, times = [], []
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            container.seek(round(first / stream.time_base) - 1, backward=True, any_frame=False, stream=stream)
            for frame in container.decode(stream):
                if frame.pts is None:
                    continue
                ts = float(frame.pts * stream.time_base)
                frames.append(frame.to_ndarray(format="rgb24"))
                times.append(ts)
                if ts >= last:
                    break
    except (av.error.FFmpegError, IndexError) as e:  # IndexError: no video stream
        raise ValueError(f"{path}: cannot decode episode {episode} ({type(e).__name__}: {e})") from None
    if not frames:
        raise ValueError(f"{path}: no frame decoded in [{first:.4f}, {last:.4f}] s (episode {episode})")
    times = np.asarray(times)
    nearest = np.abs(np.asarray(timestamps)[:, None] - times[None, :]).argmin(1)
    for want, k in zip(timestamps, nearest):
        if abs(times[k] - want) >= tolerance_s:
            raise ValueError(f"{path}: episode {episode}: no frame within {tolerance_s} s of t={want:.4f} s "
                             f"(nearest decoded t={times[k]:.4f} s)")  # fmt: skip
    return np.stack([frames[k] for k in nearest])
