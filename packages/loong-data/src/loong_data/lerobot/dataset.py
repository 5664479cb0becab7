"""A LeRobot dataset (v3.0 or v2.1) as indexable frames with action chunks.

Frame ``i`` gives its state and camera images, its task, and the action chunk of horizon ``H``:
the actions of frames ``i .. i+H-1`` of the same episode, the last one repeated past the
episode's end (``action_is_pad`` marks those), as LeRobot's ``delta_timestamps`` windows do.
Numeric columns are held in memory (small); images stay encoded until a frame is read, and cameras
stored as mp4 (dtype ``video``) are decoded by timestamp when read (:mod:`loong_data.lerobot.video`).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from loong_data.lerobot.meta import DatasetMeta, read_meta
from loong_data.lerobot.video import TOLERANCE_S, decode_frames, episode_videos


def _column(table: pa.Table, key: str, path: Path) -> pa.ChunkedArray:
    if key not in table.column_names:
        raise KeyError(f"{path}: no column {key!r} (columns: {', '.join(table.column_names)})")
    return table.column(key)


class LeRobotDataset:
    def __init__(self, root: str | Path, *, horizon: int, state_key: str = "observation.state",
                 action_key: str = "action", tolerance_s: float = TOLERANCE_S) -> None:  # fmt: skip
        self.meta: DatasetMeta = read_meta(root)
        self.horizon, self.state_key, self.action_key = horizon, state_key, action_key
        self.tolerance_s = tolerance_s
        self.camera_keys = self.meta.camera_keys()
        for key in (state_key, action_key):
            if key not in self.meta.features:
                raise KeyError(f"{self.meta.root}/meta/info.json: no feature {key!r} "
                               f"(features: {', '.join(self.meta.features)})")  # fmt: skip
        video_keys = [k for k in self.camera_keys if self.meta.features[k]["dtype"] == "video"]
        self.videos = {k: episode_videos(self.meta, k) for k in video_keys}  # per camera: episode -> file
        self._load()

    def _load(self) -> None:
        root = self.meta.root
        files = sorted((root / "data").glob("**/*.parquet"))
        if not files:
            raise FileNotFoundError(f"{root}/data: no parquet files")
        tables = [pq.read_table(f) for f in files]
        floats = (self.state_key, self.action_key)
        numeric = {
            k: [] for k in ("index", "episode_index", "frame_index", "task_index", "timestamp", *floats)
        }
        images = {k: [] for k in self.camera_keys if k not in self.videos}
        for f, t in zip(files, tables):
            for k in numeric:
                dtype = np.float32 if k in (*floats, "timestamp") else np.int64
                numeric[k].append(np.asarray(_column(t, k, f).to_pylist(), dtype=dtype))
            for k in images:
                images[k] += [cell["bytes"] for cell in _column(t, k, f).to_pylist()]
        order = np.argsort(np.concatenate(numeric["index"]), kind="stable")
        self.columns = {k: np.concatenate(v)[order] for k, v in numeric.items()}
        self.images = {k: [v[i] for i in order] for k, v in images.items()}
        ep = self.columns["episode_index"]
        starts = np.flatnonzero(np.r_[True, ep[1:] != ep[:-1]])
        ends = np.r_[starts[1:], len(ep)]
        self.episode_end = np.repeat(ends, ends - starts)  # per frame: one past its episode's last frame

    def __len__(self) -> int:
        return len(self.columns["index"])

    def image(self, key: str, i: int) -> np.ndarray:
        """Camera ``key`` of frame ``i``, uint8 [H, W, 3]."""
        if key not in self.videos:
            return np.asarray(Image.open(io.BytesIO(self.images[key][i])).convert("RGB"))
        episode = int(self.columns["episode_index"][i])
        if episode not in self.videos[key]:
            raise KeyError(
                f"{self.meta.root}/meta/episodes: no video of camera {key!r} for episode {episode}"
            )
        video = self.videos[key][episode]
        t = video.offset_s + float(self.columns["timestamp"][i])  # as LeRobot: from_timestamp + timestamp
        return decode_frames(video.path, [t], episode=episode, tolerance_s=self.tolerance_s)[0]

    def action_chunk(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        rows = np.arange(i, i + self.horizon)
        pad = rows >= self.episode_end[i]
        rows = np.minimum(rows, self.episode_end[i] - 1)
        return self.columns[self.action_key][rows], pad

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"frame {i} of {len(self)} in {self.meta.root}")
        actions, pad = self.action_chunk(i)
        return {
            "state": self.columns[self.state_key][i],
            "actions": actions,
            "action_is_pad": pad,
            "images": {k: self.image(k, i) for k in self.camera_keys},
            "task": self.meta.tasks[self.columns["task_index"][i]],
            "episode_index": int(self.columns["episode_index"][i]),
            "frame_index": int(self.columns["frame_index"][i]),
        }

    def episode_frames(self, episode: int) -> np.ndarray:
        """Row indices of ``episode``'s frames."""
        return np.flatnonzero(self.columns["episode_index"] == episode)
