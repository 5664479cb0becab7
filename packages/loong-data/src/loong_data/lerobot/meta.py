"""LeRobot dataset metadata, format v3.0 and v2.1: ``meta/info.json``, tasks, episodes, stats.

v3.0: ``meta/tasks.parquet``, ``meta/episodes/chunk-XXX/file-XXX.parquet`` (each episode's row
range ``dataset_from_index`` / ``dataset_to_index``), ``meta/stats.json``; many episodes per data
file. v2.1: ``meta/tasks.jsonl``, ``meta/episodes.jsonl``, ``meta/episodes_stats.jsonl`` (per
episode; aggregated here), one data file per episode.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from loong_data.lerobot.stats import aggregate_stats

VERSIONS = ("v2.1", "v3.0")
# columns every LeRobot data file carries besides the features proper
INDEX_COLUMNS = ("timestamp", "frame_index", "episode_index", "index", "task_index")


@dataclass
class Episode:
    index: int
    length: int
    tasks: list[str]


@dataclass
class DatasetMeta:
    root: Path
    info: dict
    tasks: list[str]  # by task_index
    episodes: list[Episode]
    stats: dict[str, dict[str, np.ndarray]]

    @property
    def version(self) -> str:
        return self.info["codebase_version"]

    @property
    def fps(self) -> float:
        return float(self.info["fps"])

    @property
    def features(self) -> dict[str, dict]:
        return self.info["features"]

    def camera_keys(self) -> list[str]:
        return [k for k, f in self.features.items() if f["dtype"] in ("image", "video")]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing (is {path.parent.parent} a LeRobot dataset?)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing (LeRobot v2.1 metadata)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stats_arrays(raw: dict) -> dict[str, dict[str, np.ndarray]]:
    return {key: {s: np.asarray(v, dtype=np.float64) for s, v in stats.items()} for key, stats in raw.items()}


def _v3_tasks(root: Path) -> list[str]:
    table = pq.read_table(root / "meta" / "tasks.parquet").to_pydict()
    # pandas writes the task strings as the index (``__index_level_0__`` or ``task``)
    names = table.get("task") or table.get("__index_level_0__")
    if names is None:
        raise ValueError(f"{root}/meta/tasks.parquet: no 'task' column (columns: {', '.join(table)})")
    tasks = [""] * len(names)
    for name, idx in zip(names, table["task_index"]):
        tasks[idx] = name
    return tasks


def _v3_episodes(root: Path) -> list[Episode]:
    files = sorted((root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
    if not files:
        raise FileNotFoundError(f"{root}/meta/episodes: no chunk-*/file-*.parquet (LeRobot v3.0 episodes)")
    rows = []
    for f in files:
        t = pq.read_table(f, columns=["episode_index", "length", "tasks"]).to_pydict()
        rows += zip(t["episode_index"], t["length"], t["tasks"])
    return [Episode(int(i), int(n), list(tasks)) for i, n, tasks in sorted(rows)]


def _v21(root: Path) -> tuple[list[str], list[Episode], dict]:
    tasks_rows = _read_jsonl(root / "meta" / "tasks.jsonl")
    tasks = [""] * len(tasks_rows)
    for row in tasks_rows:
        tasks[row["task_index"]] = row["task"]
    episodes = [
        Episode(r["episode_index"], r["length"], r["tasks"])
        for r in _read_jsonl(root / "meta" / "episodes.jsonl")
    ]
    per_episode = [_stats_arrays(r["stats"]) for r in _read_jsonl(root / "meta" / "episodes_stats.jsonl")]
    return tasks, sorted(episodes, key=lambda e: e.index), aggregate_stats(per_episode)


def read_meta(root: str | Path) -> DatasetMeta:
    """The metadata of the LeRobot dataset at ``root`` (v3.0 or v2.1)."""
    root = Path(root)
    info = _read_json(root / "meta" / "info.json")
    version = info.get("codebase_version")
    if version not in VERSIONS:
        raise ValueError(
            f"{root}/meta/info.json: codebase_version={version!r}; supported: {', '.join(VERSIONS)}"
        )
    for key in ("fps", "features", "data_path"):
        if key not in info:
            raise ValueError(f"{root}/meta/info.json: no {key!r}")
    if version == "v3.0":
        tasks, episodes = _v3_tasks(root), _v3_episodes(root)
        stats = _stats_arrays(_read_json(root / "meta" / "stats.json"))
    else:
        tasks, episodes, stats = _v21(root)
    return DatasetMeta(root, info, tasks, episodes, stats)
