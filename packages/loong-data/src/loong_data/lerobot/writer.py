"""Writes a LeRobot dataset (format v3.0, or v2.1) from whole episodes: states, actions, camera
frames (PNG in the parquet, LeRobot's ``image`` dtype), a task string per episode."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from loong_data.lerobot.meta import VERSIONS
from loong_data.lerobot.stats import feature_stats

DATA_PATH = {"v3.0": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
             "v2.1": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"}  # fmt: skip


def _png(frame: np.ndarray) -> dict:
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG", optimize=True)
    return {"bytes": buf.getvalue(), "path": None}


def _hf_features(features: dict) -> str:
    """The ``huggingface`` schema metadata by which ``datasets`` decodes the columns."""
    out = {}
    for key, f in features.items():
        if f["dtype"] == "image":
            out[key] = {"_type": "Image"}
        elif f["shape"] == [1]:
            out[key] = {"dtype": f["dtype"], "_type": "Value"}
        else:
            out[key] = {
                "feature": {"dtype": f["dtype"], "_type": "Value"},
                "length": f["shape"][0],
                "_type": "Sequence",
            }
    return json.dumps({"info": {"features": out}})


@dataclass
class LeRobotWriter:
    """``add_episode`` for each episode, then ``finish``. ``state_names`` / ``action_names`` name
    the vector entries; ``cameras`` maps a camera key to its (height, width)."""

    root: Path
    fps: int
    state_names: list[str]
    action_names: list[str]
    cameras: dict[str, tuple[int, int]]
    robot_type: str = "unknown"
    version: str = "v3.0"
    _episodes: list[dict] = field(default_factory=list)
    _tasks: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.version not in VERSIONS:
            raise ValueError(f"LeRobot version {self.version!r}; allowed: {', '.join(VERSIONS)}")
        self.root = Path(self.root)

    @property
    def features(self) -> dict:
        f = {k: {"dtype": "image", "shape": [h, w, 3], "names": ["height", "width", "channel"]}
             for k, (h, w) in self.cameras.items()}  # fmt: skip
        f["observation.state"] = {
            "dtype": "float32",
            "shape": [len(self.state_names)],
            "names": self.state_names,
        }
        f["action"] = {"dtype": "float32", "shape": [len(self.action_names)], "names": self.action_names}
        f["timestamp"] = {"dtype": "float32", "shape": [1], "names": None}
        for k in ("frame_index", "episode_index", "index", "task_index"):
            f[k] = {"dtype": "int64", "shape": [1], "names": None}
        return f

    def add_episode(
        self, state: np.ndarray, action: np.ndarray, images: dict[str, np.ndarray], task: str
    ) -> None:
        n = len(state)
        if len(action) != n or any(len(v) != n for v in images.values()):
            raise ValueError(
                f"episode {len(self._episodes)}: state, action and camera frames differ in length"
            )
        if set(images) != set(self.cameras):
            raise ValueError(
                f"episode {len(self._episodes)}: cameras {sorted(images)}, expected {sorted(self.cameras)}"
            )
        self._tasks.setdefault(task, len(self._tasks))
        self._episodes.append(dict(state=np.asarray(state, np.float32), action=np.asarray(action, np.float32),
                                   images=images, task=task))  # fmt: skip

    def _table(self, first_index: int, ep_index: int, ep: dict) -> pa.Table:
        n = len(ep["state"])
        cols = {k: pa.array([_png(x) for x in ep["images"][k]]) for k in self.cameras}
        cols["observation.state"] = pa.array(list(ep["state"]), pa.list_(pa.float32()))
        cols["action"] = pa.array(list(ep["action"]), pa.list_(pa.float32()))
        cols["timestamp"] = pa.array(np.arange(n, dtype=np.float32) / self.fps)
        cols["frame_index"] = pa.array(np.arange(n, dtype=np.int64))
        cols["episode_index"] = pa.array(np.full(n, ep_index, dtype=np.int64))
        cols["index"] = pa.array(np.arange(first_index, first_index + n, dtype=np.int64))
        cols["task_index"] = pa.array(np.full(n, self._tasks[ep["task"]], dtype=np.int64))
        return pa.table(cols).replace_schema_metadata({"huggingface": _hf_features(self.features)})

    def _write(self, rel: str, table: pa.Table) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)

    def _stats(self, episodes: list[dict]) -> dict:
        cat = lambda key: np.concatenate([ep[key] for ep in episodes])  # noqa: E731
        stats = {"observation.state": feature_stats(cat("state")), "action": feature_stats(cat("action"))}
        for k in self.cameras:
            stats[k] = feature_stats(np.concatenate([ep["images"][k] for ep in episodes]))
        return {k: {s: v.tolist() for s, v in st.items()} for k, st in stats.items()}

    def finish(self) -> Path:
        """Write the data files and the metadata; returns the dataset root."""
        if not self._episodes:
            raise ValueError(f"{self.root}: no episodes to write")
        lengths = [len(ep["state"]) for ep in self._episodes]
        starts = np.r_[0, np.cumsum(lengths)[:-1]]
        tables = [self._table(int(s), i, ep) for i, (s, ep) in enumerate(zip(starts, self._episodes))]
        (self._finish_v30 if self.version == "v3.0" else self._finish_v21)(tables, lengths, starts)
        info = dict(codebase_version=self.version, robot_type=self.robot_type, total_episodes=len(lengths),
                    total_frames=int(sum(lengths)), total_tasks=len(self._tasks), chunks_size=1000, fps=self.fps,
                    splits={"train": f"0:{len(lengths)}"}, data_path=DATA_PATH[self.version], video_path=None,
                    features=self.features)  # fmt: skip
        if self.version == "v3.0":
            info.update(data_files_size_in_mb=100, video_files_size_in_mb=200)
        else:
            info.update(total_chunks=1, total_videos=0)
        (self.root / "meta" / "info.json").write_text(json.dumps(info, indent=2))
        return self.root

    def _finish_v30(self, tables: list[pa.Table], lengths: list[int], starts: np.ndarray) -> None:
        self._write("data/chunk-000/file-000.parquet", pa.concat_tables(tables))
        eps = {"episode_index": list(range(len(lengths))), "tasks": [[ep["task"]] for ep in self._episodes],
               "length": lengths, "data/chunk_index": [0] * len(lengths), "data/file_index": [0] * len(lengths),
               "dataset_from_index": [int(s) for s in starts],
               "dataset_to_index": [int(s + n) for s, n in zip(starts, lengths)]}  # fmt: skip
        self._write("meta/episodes/chunk-000/file-000.parquet", pa.table(eps))
        tasks = sorted(self._tasks.items(), key=lambda kv: kv[1])
        self._write(
            "meta/tasks.parquet",
            pa.table({"task_index": [i for _, i in tasks], "task": [t for t, _ in tasks]}),
        )
        (self.root / "meta" / "stats.json").write_text(json.dumps(self._stats(self._episodes)))

    def _finish_v21(self, tables: list[pa.Table], lengths: list[int], starts: np.ndarray) -> None:
        meta = self.root / "meta"
        meta.mkdir(parents=True, exist_ok=True)
        for i, t in enumerate(tables):
            self._write(DATA_PATH["v2.1"].format(episode_chunk=0, episode_index=i), t)
        lines = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)  # noqa: E731
        (meta / "episodes.jsonl").write_text(lines({"episode_index": i, "tasks": [ep["task"]], "length": n}
                                                   for i, (ep, n) in enumerate(zip(self._episodes, lengths))))  # fmt: skip
        (meta / "tasks.jsonl").write_text(lines({"task_index": i, "task": t} for t, i in self._tasks.items()))
        (meta / "episodes_stats.jsonl").write_text(lines({"episode_index": i, "stats": self._stats([ep])}
                                                         for i, ep in enumerate(self._episodes)))  # fmt: skip
