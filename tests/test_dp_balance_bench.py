"""bench/dp_balance.py: runs alternate, and every figure (median, mean, total) covers all runs."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from dp_balance import run_order, summarize  # noqa: E402


def test_runs_alternate_so_neither_setting_always_goes_first():
    assert run_order(1) == [False, True]
    assert run_order(3) == [False, True, True, False, False, True]


def test_summary_reports_median_mean_and_total_over_every_run():
    runs = [[{"step_time_s": 1.0, "tokens": 100, "loss": 3.0}, {"step_time_s": 3.0, "tokens": 100, "loss": 2.5}],
            [{"step_time_s": 2.0, "tokens": 100, "loss": 3.0}, {"step_time_s": 10.0, "tokens": 100, "loss": 2.4}]]  # fmt: skip
    s = summarize(runs)
    assert (s["median_s"], s["mean_s"], s["total_s"]) == (2.5, 4.0, 16.0)
    assert s["tokens_per_s"] == pytest.approx(400 / 16) and s["losses"] == [2.5, 2.4]
