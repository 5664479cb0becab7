"""bench/pi05_throughput.py at the tiny shape on CPU: the real train app (bf16) and the LeRobot-side
worker (the transcription; the lerobot wheel cannot install next to the workspace's torch) train
the same samples, and the script reports both stacks' samples/s and their ratio."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))
from pi05_throughput import Row, check_same_data, report  # noqa: E402


def test_pi05_bench_trains_both_stacks_on_the_same_samples_and_reports_the_ratio_per_variant(tmp_path):
    out = tmp_path / "figures.json"
    cmd = [sys.executable, str(BENCH / "pi05_throughput.py"), "--model", "pi05-tiny", "--device", "cpu",
           "--reference", "transcription", "--steps", "3", "--warmup", "1", "--batch", "2", "--json", str(out),
           "--variant", "eager", "model.embodied.attention_impl=eager",
           "--variant", "broken", "model.embodied.compile_mode=graphs"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "dtype bfloat16" in proc.stdout  # Loong trained at the precision asked for
    assert "model.embodied.attention_impl=eager" in proc.stdout  # the variant's overrides reached its run
    assert "eager #1: median step" in proc.stdout
    # a variant that cannot run is named and left out; the others' figures stand
    assert "variant 'broken' left out of every round" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["steps_compared"] == 2
    assert figures["loong_samples_per_s"] > 0 and figures["reference_samples_per_s"] > 0
    ratio = figures["loong_samples_per_s"] / figures["reference_samples_per_s"]
    assert figures["ratio"] == pytest.approx(ratio)
    assert list(figures["variants"]) == ["eager"]  # one round: the variant's ratio is its run's
    assert figures["variants"]["eager"]["ratio"] == pytest.approx(ratio)


def test_pi05_bench_refuses_stacks_that_trained_different_samples():
    same = [{"samples": 2, "digest": 7}, {"samples": 2, "digest": 9}]
    a, b = Row("a", [1.0, 1.0], 0.0, same), Row("b", [1.0, 1.0], 0.0, [same[0], {"samples": 2, "digest": 8}])
    check_same_data(a, Row("c", [1.0, 1.0], 0.0, list(same)))
    with pytest.raises(SystemExit, match="different data at step 2"):
        check_same_data(a, b)


def test_pi05_bench_pools_each_stack_over_its_rounds_and_reports_each_rounds_ratio(capsys):
    def row(*times):
        return Row("x", [9.0, *times], 1.0, [])  # the first step is warm-up

    rounds = [{"a": row(1.0, 1.0), "b": row(2.0, 2.0), "ref": row(3.0, 3.0)},
              {"a": row(3.0, 3.0), "b": row(1.0, 1.0), "ref": row(3.0, 3.0)},
              {"a": row(2.0, 2.0), "b": row(1.5, 1.5), "ref": row(6.0, 6.0)}]  # fmt: skip
    figures = report(rounds, "ref", warmup=1, batch=4)
    assert figures["best"] == "b" and figures["rounds"] == 3 and figures["steps_compared"] == 2
    assert figures["variants"]["a"]["step_s"] == 2.0 and figures["variants"]["b"]["step_s"] == 1.5
    assert figures["variants"]["a"]["round_ratios"] == [3.0, 1.0, 3.0]
    assert figures["ratio"] == pytest.approx(3.0 / 1.5)  # the medians over all rounds, not of the ratios
    assert figures["reference_samples_per_s"] == pytest.approx(4 / 3.0)
    assert "b #2" in capsys.readouterr().out
