"""A metrics record reports the window of steps since the last logged one: the tokens, throughput
and MFU of the window, the last step's result, and media fields only for data with media."""

import time
from dataclasses import dataclass

import pytest

from loong_parallel import StepClock, StepResult, StepWindow


@dataclass
class Counts:
    tokens: int
    images: int | None = None
    samples: int | None = None
    digest: int | None = None


RESULT = StepResult(loss=2.5, num_tokens=64, grad_norm=1.5, lr=1e-3, skipped=False)


def test_a_record_sums_the_window_and_reports_the_last_step():
    w = StepWindow()
    w.add(Counts(tokens=100), 1e9, step_time=0.5)
    w.add(Counts(tokens=60), 1e9, step_time=0.25)
    record, postfix = w.record(7, RESULT, world_size=2, peak_flops=None)
    assert (w.steps, record["step"], record["tokens"], record["step_time_s"]) == (2, 7, 160, 0.25)
    assert (record["loss"], record["lr"], record["grad_norm"], record["skipped"], record["nonfinite"]) == (
        2.5, 1e-3, 1.5, False, False)  # fmt: skip
    assert record["tokens_per_s_per_device"] == pytest.approx(record["tokens_per_s"] / 2)
    assert "mfu" not in record and "images_per_s" not in record and "step_digest" not in record
    assert postfix["loss"] == "2.5000"


def test_a_step_whose_forward_backward_was_timed_reports_it_and_others_do_not():
    w = StepWindow()
    w.add(Counts(tokens=10), 0.0, step_time=0.5)
    timed = StepResult(loss=2.5, num_tokens=64, grad_norm=1.5, lr=1e-3, skipped=False, compute_s=0.375)
    assert w.record(1, timed, world_size=1, peak_flops=None)[0]["compute_s"] == 0.375
    assert "compute_s" not in w.record(1, RESULT, world_size=1, peak_flops=None)[0]


def test_throughput_and_mfu_are_over_the_window_time():
    w = StepWindow()
    w.add(Counts(tokens=1000), 4e12, step_time=0.1)
    time.sleep(0.05)
    before = time.perf_counter() - w.t0
    record, _ = w.record(1, RESULT, world_size=4, peak_flops=1e12)
    after = time.perf_counter() - w.t0
    assert 1000 / after <= record["tokens_per_s"] <= 1000 / before
    assert 4e12 / after / 4 / 1e12 <= record["mfu"] <= 4e12 / before / 4 / 1e12


def test_data_with_media_adds_images_per_s_and_the_last_steps_counts():
    w = StepWindow()
    w.add(Counts(tokens=10, images=2, samples=3, digest=11), 0.0, step_time=0.1)
    w.add(Counts(tokens=20, images=4, samples=5, digest=22), 0.0, step_time=0.1)
    record, _ = w.record(2, RESULT, world_size=1, peak_flops=None)
    assert record["images_per_s"] > 0
    assert (record["step_tokens"], record["step_images"], record["step_samples"], record["step_digest"]) == (20, 4, 5, 22)


def test_text_data_with_a_digest_reports_it_without_media_fields():
    w = StepWindow()
    w.add(Counts(tokens=10, digest=7), 0.0, step_time=0.1)
    record, _ = w.record(1, RESULT, world_size=1, peak_flops=None)
    assert record["step_digest"] == 7 and "images_per_s" not in record and "step_images" not in record


def test_step_times_add_up_to_the_wall_time_and_pauses_are_left_out():
    syncs = []
    clock = StepClock(sync=lambda: syncs.append(1))
    begin = time.perf_counter()
    t0 = clock.start()
    time.sleep(0.01)
    first = clock.lap(t0)
    time.sleep(0.01)  # between steps (logging): the next step's time
    second = clock.lap(clock.start())
    assert first >= 0.01 and second >= 0.01 and len(syncs) == 2
    assert first + second == pytest.approx(time.perf_counter() - begin, abs=2e-3)
    with clock.paused():
        time.sleep(0.05)  # an evaluation
    time.sleep(0.01)
    assert 0.01 <= clock.lap(clock.start()) < 0.05
    assert StepClock().lap(StepClock().start()) >= 0  # without sync (train.sync_steps=false)
