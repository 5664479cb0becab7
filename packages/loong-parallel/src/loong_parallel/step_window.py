"""The window of steps whose throughput a metrics record reports: what the steps since the last
logged one consumed (the data's counts) and cost (time, the model's FLOPs), with the last step's
:class:`~loong_parallel.StepResult`."""

from __future__ import annotations

import time
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
            record.update(step_tokens=self.last.tokens, step_images=self.last.images, step_samples=self.last.samples,
                          step_digest=self.last.digest)
        if peak_flops:
            record["mfu"] = self.flops / elapsed / world_size / peak_flops
        return record, {"loss": f"{result.loss:.4f}", "tok_s": f"{tps:,.0f}"}
