"""The window of steps whose throughput a metrics record reports: what the steps since the last
logged one consumed (the data's counts) and cost (time, the model's FLOPs), with the last step's
:class:`~loong_parallel.StepResult`."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from loong_parallel.step import StepResult


class StepCounts(Protocol):
    """What one step consumed (loong_data.step_data.StepCounts): tokens, and the media (None:
    the data kind has none)."""

    tokens: int
    images: int | None
    samples: int | None
    digest: int | None


class StepWindow:
    """What the steps since the last logged one consumed and cost: throughput and MFU over the window."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.steps = self.tokens = self.images = 0
        self.flops = 0.0
        self.step_time = 0.0
        self.has_media = False

    def add(self, counts: StepCounts, flops: float, *, step_time: float) -> None:
        self.steps += 1
        self.last = counts
        self.tokens += counts.tokens
        self.flops += flops
        self.step_time = step_time
        if counts.images is not None:
            self.has_media = True
            self.images += counts.images

    def record(self, step: int, result: StepResult, *, world_size: int, peak_flops: float | None) -> tuple[dict, dict]:
        """The metrics record of the window ending at ``step``, and the progress bar's postfix."""
        elapsed = time.perf_counter() - self.t0
        tps = self.tokens / elapsed
        record = {
            "step": step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
            "tokens_per_s": tps, "tokens_per_s_per_device": tps / world_size, "step_time_s": self.step_time,
            "skipped": result.skipped, "nonfinite": result.nonfinite, "tokens": self.tokens,  # in the window: the step when log_interval=1
        }  # fmt: skip
        if self.has_media:
            record["images_per_s"] = self.images / elapsed  # + the last step's data (benches compare stacks):
            record.update(step_tokens=self.last.tokens, step_images=self.last.images, step_samples=self.last.samples)
        if self.last.digest is not None:  # what the last step trained on (benches assert stacks agree)
            record["step_digest"] = self.last.digest
        if result.compute_s is not None:  # the last step's forward-backward (train.time_compute, DP balancing)
            record["compute_s"] = result.compute_s
        if peak_flops:
            record["mfu"] = self.flops / elapsed / world_size / peak_flops
        return record, {"loss": f"{result.loss:.4f}", "tok_s": f"{tps:,.0f}"}


class StepClock:
    """Step times that add up to the training wall time (less the time spent in :meth:`paused`):
    a step's time runs from the previous step's end (the first step's from its own start) to its
    own. With ``sync`` (the accelerator's synchronize) a step ends when the device has run it;
    without (``train.sync_steps=false``) when its work is queued, and the device's tail of it is
    then waited for inside the next step, whose time it joins."""

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        self._end: float | None = None

    def start(self) -> float:
        return self._end if self._end is not None else time.perf_counter()

    def lap(self, t0: float) -> float:
        """The time of the step that started at ``t0`` (:meth:`start`), which ends now."""
        if self.sync is not None:
            self.sync()
        self._end = time.perf_counter()
        return self._end - t0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Work between steps that is no step's (evaluation, saving): its time is left out."""
        t = time.perf_counter()
        try:
            yield
        finally:
            if self._end is not None:
                self._end += time.perf_counter() - t
