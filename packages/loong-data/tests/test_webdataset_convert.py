"""``loong-data convert-to-webdataset``: real tar shards, bad records by file:line, atomic output."""

import json
import shutil
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from loong_data.cli import main
from loong_data.multimodal import (
    ConvertError,
    bundled_multimodal_shards,
    convert_to_webdataset,
    default_multimodal_dataset,
)

SAMPLE = default_multimodal_dataset()


def test_bundled_set_converts_to_readable_shards_within_maxcount(tmp_path: Path) -> None:
    out = tmp_path / "shards"
    report = convert_to_webdataset([SAMPLE / "conversations.jsonl"], out, maxcount=50, progress=False)
    assert report.num_samples == 336 and report.num_skipped == 0 and len(report.shards) == 7
    assert report.counts == {"image": 244, "multi-image": 50, "video": 6, "mixed": 6, "text": 30}
    manifest = json.loads((out / "manifest.json").read_text())
    assert [s["num_samples"] for s in manifest["shards"]] == [50] * 6 + [36]
    source = [json.loads(line) for line in (SAMPLE / "conversations.jsonl").read_text().splitlines()]
    samples = list(wds.WebDataset([str(s) for s in report.shards], shardshuffle=False, empty_check=False))
    assert len(samples) == 336 and len({s["__key__"] for s in samples}) == 336
    for sample, record in zip(samples, source):
        converted = json.loads(sample["json"])
        assert converted["id"] == record["id"]
        assert converted["source"].endswith(f"conversations.jsonl:{source.index(record) + 1}")
        # Every media reference names a member of the same sample holding the original bytes.
        originals = [
            item[item["type"]]
            for m in record["messages"]
            if isinstance(m["content"], list)
            for item in m["content"]
            if item["type"] in ("image", "video")
        ]
        refs = [
            item[item["type"]]
            for m in converted["messages"]
            for item in m["content"]
            if item["type"] in ("image", "video")
        ]
        assert len(refs) == len(originals)
        for original, ref in zip(originals, refs):
            if isinstance(ref, list):  # video: its frames, in order
                frames = sorted((SAMPLE / original).glob("*.jpg"))
                assert [sample[r] for r in ref] == [f.read_bytes() for f in frames]
            else:
                assert sample[ref] == (SAMPLE / original).read_bytes()


def _bad_input(tmp_path: Path) -> Path:
    """A JSONL file with good records and, on lines 2-5, each kind of bad record."""
    media = tmp_path / "media"
    media.mkdir()
    shutil.copy(SAMPLE / "images/coffee.jpg", media / "coffee.jpg")
    data = (SAMPLE / "images/astronaut.jpg").read_bytes()
    (media / "broken.jpg").write_bytes(data[: len(data) // 3])  # truncated: the header decodes, pixels do not

    def record(content: list, answer: str = "A cup.") -> str:
        messages = [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        return json.dumps({"messages": messages})

    lines = [
        record([{"type": "image", "image": "media/coffee.jpg"}, {"type": "text", "text": "What is it?"}]),
        record([{"type": "image", "image": "media/missing.jpg"}]),
        record([{"type": "image", "image": "media/broken.jpg"}]),
        '{"messages": [{"role": "user", "content": "unterminated',
        json.dumps({"messages": [{"role": "user", "content": "no answer"}]}),
        record([{"type": "text", "text": "Text only."}], "Fine."),
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_bad_records_are_reported_with_file_and_line_and_skipped(tmp_path: Path) -> None:
    path = _bad_input(tmp_path)
    report = convert_to_webdataset([path], tmp_path / "out", progress=False)
    assert report.num_samples == 2 and report.num_skipped == 4
    assert [e.split(": ", 1)[0] for e in report.errors] == [f"{path}:{n}" for n in (2, 3, 4, 5)]
    assert "media file not found" in report.errors[0] and "missing.jpg" in report.errors[0]
    assert "cannot decode image" in report.errors[1] and "broken.jpg" in report.errors[1]
    assert "not valid JSON" in report.errors[2] and "no assistant turn" in report.errors[3]
    with tarfile.open(report.shards[0]) as tar:
        assert sorted(tar.getnames()) == ["00000000.img0.jpg", "00000000.json", "00000001.json"]


def test_stop_on_error_leaves_no_output(tmp_path: Path) -> None:
    path = _bad_input(tmp_path)
    with pytest.raises(ConvertError, match=f"{path}:2: media file not found"):
        convert_to_webdataset([path], tmp_path / "out", on_error="stop", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl", "media"]  # no out, no .partial


def test_existing_output_is_kept_unless_overwrite(tmp_path: Path) -> None:
    path = _bad_input(tmp_path)
    first = convert_to_webdataset([path], tmp_path / "out", progress=False)
    with pytest.raises(ConvertError, match="exists and is not empty"):
        convert_to_webdataset([path], tmp_path / "out", progress=False)
    again = convert_to_webdataset([path], tmp_path / "out", maxcount=1, overwrite=True, progress=False)
    assert len(first.shards) == 1 and len(again.shards) == 2


def test_video_inputs(tmp_path: Path) -> None:
    frames = sorted((SAMPLE / "videos/pan-rocket").glob("*.jpg"))[:3]
    messages = lambda video: [  # noqa: E731
        {
            "role": "user",
            "content": [{"type": "video", "video": video}, {"type": "text", "text": "Where to?"}],
        },
        {"role": "assistant", "content": "Up."},
    ]
    (tmp_path / "clip.mp4").write_bytes(b"\x00" * 64)
    records = [
        {"messages": messages([str(f) for f in frames])},  # a list of frames (absolute paths)
        {"messages": messages(str(SAMPLE / "videos/pan-rocket"))},  # a folder of frames
        {"messages": messages("clip.mp4")},  # a video file: no decoder
    ]
    path = tmp_path / "videos.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    report = convert_to_webdataset([path], tmp_path / "out", progress=False)
    assert report.counts == {"video": 2} and report.errors[0].startswith(f"{path}[2]: ")
    assert "video files need a decoder" in report.errors[0]
    with tarfile.open(report.shards[0]) as tar:
        names = tar.getnames()
    assert sum(n.startswith("00000000.vid0.") for n in names) == 3
    assert sum(n.startswith("00000001.vid0.") for n in names) == 8


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = _bad_input(tmp_path)
    assert main(["convert-to-webdataset", "--out", str(tmp_path / "out"), "--quiet", str(path)]) == 0
    captured = capsys.readouterr()
    assert "2 samples (1 image, 1 text) in 1 shards, 4 bad records skipped" in captured.out
    assert f"skipped {path}:3: cannot decode image" in captured.err
    code = main(
        ["convert-to-webdataset", "--out", str(tmp_path / "o2"), "--on-error", "stop", "--quiet", str(path)]
    )
    assert code == 1 and f"{path}:2: media file not found" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


def test_bundled_shards_are_converted_once_and_reused(tmp_path: Path) -> None:
    out = bundled_multimodal_shards(tmp_path / "vlm", maxcount=100)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_samples"] == 336 and len(manifest["shards"]) == 4 and manifest["fingerprint"]
    stamp = (out / "shard-000000.tar").stat().st_mtime_ns
    assert bundled_multimodal_shards(tmp_path / "vlm", maxcount=100) == out
    assert (out / "shard-000000.tar").stat().st_mtime_ns == stamp  # reused
    bundled_multimodal_shards(tmp_path / "vlm", maxcount=200)  # other settings: converted again
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) == 2


def test_maxsize_starts_new_shards(tmp_path: Path) -> None:
    report = convert_to_webdataset(
        [SAMPLE / "conversations.jsonl"], tmp_path / "out", maxsize=300_000, progress=False
    )
    sizes = [s.stat().st_size for s in report.shards]
    assert len(sizes) >= 5 and all(size <= 300_000 for size in sizes) and sum(sizes[:-1]) > 4 * 250_000
    assert (
        report.num_samples
        == 336
        == sum(
            1 for _ in wds.WebDataset([str(s) for s in report.shards], shardshuffle=False, empty_check=False)
        )
    )


def test_same_input_same_bytes(tmp_path: Path) -> None:
    path = _bad_input(tmp_path)
    first = convert_to_webdataset([path], tmp_path / "a", progress=False)
    second = convert_to_webdataset([path], tmp_path / "b", progress=False)
    assert first.shards[0].read_bytes() == second.shards[0].read_bytes()
