"""LeRobot cameras stored as mp4: the reader decodes the frame at each frame's timestamp, exactly the
frame LeRobot's PyAV decoder returns, and names the file and episode when the video is bad.

The videos are real mp4 files written here (lossless H.264 RGB, a keyframe every 8 frames so that
reads seek) from the frames of the bundled Metaworld dataset (v3.0: all episodes in one file) and
of a writer-made v2.1 dataset (one file per episode)."""

import io
import json
import re
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from loong_data.bundled import default_robot_dataset
from loong_data.lerobot import LeRobotDataset, LeRobotWriter

av = pytest.importorskip("av", reason="loong-data[video] (PyAV) is not installed")

V3_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V21_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"


def lerobot_decode(path: Path, timestamps: list[float], tolerance_s: float) -> np.ndarray:
    """LeRobot's decoder, uint8 [N, H, W, 3]: ``lerobot.datasets.video_utils.decode_video_frames_pyav``
    when lerobot imports (its Pi0.5 releases pin torch < 2.12, so not in this workspace), else its
    code transcribed (lerobot 0.6.1, Apache-2.0): seek to the keyframe before the first time,
    decode forward past the last, take the nearest frame within the tolerance."""
    try:
        from lerobot.datasets.video_utils import decode_video_frames_pyav
    except ImportError:
        decode_video_frames_pyav = None
    if decode_video_frames_pyav is not None:
        frames = decode_video_frames_pyav(path, timestamps, tolerance_s, return_uint8=True)
        return frames.permute(0, 2, 3, 1).numpy()
    loaded, loaded_ts = [], []
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        container.seek(
            round(min(timestamps) / stream.time_base) - 1, backward=True, any_frame=False, stream=stream
        )
        for frame in container.decode(stream):
            if frame.pts is None:
                continue
            current_ts = float(frame.pts * stream.time_base)
            loaded.append(frame.to_ndarray(format="rgb24"))
            loaded_ts.append(current_ts)
            if current_ts >= max(timestamps):
                break
    dist = np.abs(np.asarray(timestamps)[:, None] - np.asarray(loaded_ts)[None, :])
    assert (dist.min(1) < tolerance_s).all(), "LeRobot would refuse these timestamps"
    return np.stack([loaded[i] for i in dist.argmin(1)])


def encode(path: Path, frames: list[np.ndarray], fps: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264rgb", rate=fps, options={"crf": "0", "g": "8"})
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "rgb24"
        for i, f in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(f, format="rgb24")
            frame.pts, frame.time_base = i, Fraction(1, fps)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def to_video(src: Path, dst: Path) -> dict[int, list[np.ndarray]]:
    """Copy the LeRobot dataset ``src`` to ``dst`` with its camera moved from PNG cells into mp4
    files; returns the source frames per episode."""
    shutil.copytree(src, dst)
    info = json.loads((dst / "meta" / "info.json").read_text())
    key = next(k for k, f in info["features"].items() if f["dtype"] == "image")
    fps, frames = info["fps"], {}
    for f in sorted((dst / "data").glob("**/*.parquet")):
        t = pq.read_table(f)
        cells = [c["bytes"] for c in t.column(key).to_pylist()]
        for ep, cell in zip(t.column("episode_index").to_pylist(), cells):  # rows in frame order
            frames.setdefault(ep, []).append(np.asarray(Image.open(io.BytesIO(cell)).convert("RGB")))
        pq.write_table(t.drop_columns([key]), f)
    info["features"][key]["dtype"] = "video"
    info["features"][key]["info"] = {"video.fps": fps, "video.codec": "h264", "video.pix_fmt": "rgb24"}
    if info["codebase_version"] == "v3.0":
        info["video_path"] = V3_PATH
        encode(dst / V3_PATH.format(video_key=key, chunk_index=0, file_index=0),
               [x for ep in sorted(frames) for x in frames[ep]], fps)  # fmt: skip
        ep_file = dst / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
        t = pq.read_table(ep_file)
        starts = np.cumsum([0] + [len(frames[e]) for e in t.column("episode_index").to_pylist()])
        cols = {"chunk_index": [0] * len(t), "file_index": [0] * len(t),
                "from_timestamp": (starts[:-1] / fps).tolist(), "to_timestamp": (starts[1:] / fps).tolist()}  # fmt: skip
        for name, values in cols.items():
            t = t.append_column(f"videos/{key}/{name}", pa.array(values))
        pq.write_table(t, ep_file)
    else:
        info["video_path"] = V21_PATH
        for ep, xs in frames.items():
            encode(dst / V21_PATH.format(episode_chunk=0, video_key=key, episode_index=ep), xs, fps)
    (dst / "meta" / "info.json").write_text(json.dumps(info, indent=2))
    return frames


def writer_v21(root: Path) -> Path:
    rng = np.random.default_rng(0)
    w = LeRobotWriter(root, fps=10, state_names=["a"], action_names=["x"], cameras={"observation.images.top": (16, 16)},
                      version="v2.1")  # fmt: skip
    for n in (12, 9):
        w.add_episode(state=rng.normal(size=(n, 1)).astype(np.float32), action=rng.normal(size=(n, 1)).astype(np.float32),
                      images={"observation.images.top": rng.integers(0, 255, (n, 16, 16, 3), dtype=np.uint8)}, task="t")  # fmt: skip
    return w.finish()


@pytest.fixture(scope="module", params=["v3.0", "v2.1"])
def video_dataset(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param.replace(".", ""))
    src = default_robot_dataset() if request.param == "v3.0" else writer_v21(tmp / "src")
    frames = to_video(Path(src), tmp / "video")
    return LeRobotDataset(tmp / "video", horizon=4), frames


def test_video_frames_are_the_encoded_frames_and_lerobots_decode(video_dataset):
    ds, frames = video_dataset
    key = ds.camera_keys[0]
    assert ds.videos and key in ds.videos
    rows = np.linspace(0, len(ds) - 1, 12).astype(int)  # across episodes, mid-GOP and keyframe frames
    for i in rows:
        ep, fi = int(ds.columns["episode_index"][i]), int(ds.columns["frame_index"][i])
        ours = ds[i]["images"][key]
        np.testing.assert_array_equal(ours, frames[ep][fi], err_msg=f"episode {ep} frame {fi}")  # lossless
        video = ds.videos[key][ep]
        theirs = lerobot_decode(video.path, [video.offset_s + float(ds.columns["timestamp"][i])], 1e-4)
        np.testing.assert_array_equal(ours, theirs[0])


def test_a_bad_video_names_its_file_and_episode(video_dataset, tmp_path):
    ds, _ = video_dataset
    key = ds.camera_keys[0]
    last = int(ds.columns["episode_index"][-1])
    video = ds.videos[key][last]
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 50)
    for path, error, match in ((tmp_path / "absent.mp4", FileNotFoundError, "missing video"),
                               (broken, ValueError, "cannot decode")):  # fmt: skip
        ds.videos[key][last] = type(video)(path, video.offset_s)
        with pytest.raises(error, match=rf"{re.escape(str(path))}: {match}.*episode {last}"):
            ds.image(key, len(ds) - 1)
    # a timestamp between two frames (the episode's start shifted by half a frame) is refused
    ds.videos[key][last] = type(video)(video.path, video.offset_s + 0.5 / ds.meta.fps)
    with pytest.raises(ValueError, match=rf"{re.escape(str(video.path))}: episode {last}: no frame within"):
        ds.image(key, len(ds) - 1)
    ds.videos[key][last] = video
