"""A run's metrics file and TensorBoard events: one record per line, a fresh run starts them
anew, a resumed run keeps the records up to its checkpoint, and other ranks write nothing."""

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from loong_ckpt.run_metrics import MetricsWriter


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(out, steps, **kw):
    w = MetricsWriter(out, enabled=True, tensorboard=False, **kw)
    for s in steps:
        w.write({"step": s, "loss": 1.0 / s})
    w.close()
    return w


def test_each_record_is_one_json_line_in_metrics_jsonl(tmp_path):
    w = _write(tmp_path / "run", [1, 2, 3])
    assert w.path == tmp_path / "run" / "metrics.jsonl"
    assert [r["step"] for r in _records(w.path)] == [1, 2, 3]


def test_a_fresh_run_replaces_the_previous_records(tmp_path):
    _write(tmp_path, [1, 2, 3])
    assert [r["step"] for r in _records(_write(tmp_path, [1]).path)] == [1]


def test_a_resumed_run_keeps_the_records_up_to_its_checkpoint_and_replaces_the_rest(tmp_path):
    _write(tmp_path, [1, 2, 3, 4])
    w = _write(tmp_path, [3, 4], resume_step=2)
    assert [r["step"] for r in _records(w.path)] == [1, 2, 3, 4]
    assert _records(w.path)[2]["loss"] == 1.0 / 3


def test_a_writer_that_is_not_the_main_rank_writes_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "run", enabled=False, tensorboard=True)
    w.write({"step": 1, "loss": 2.0})
    w.close()
    assert not (tmp_path / "run").exists()


def test_numeric_fields_go_to_tensorboard_under_their_split(tmp_path):
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=True)
    w.write({"step": 1, "loss": 2.5, "lr": 1e-3, "skipped": False, "note": "text"})
    w.write({"step": 1, "split": "val", "loss": 3.0})
    w.close()
    events = EventAccumulator(str(w.tb_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "val/loss"} <= tags and "train/note" not in tags
    assert events.Scalars("val/loss")[0].value == 3.0 and events.Scalars("train/loss")[0].step == 1
