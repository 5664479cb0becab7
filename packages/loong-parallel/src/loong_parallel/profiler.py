"""A torch-profiler window over a few optimizer steps, written as a table of the
most expensive operators (per device kernel time on an accelerator, CPU time otherwise) and,
optionally, a Chrome trace. Off by default; a run profiles steps ``start_step`` to
``start_step + steps - 1`` so that warm-up (allocator growth, autotuning, first compiles) is left
out of the window."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from loong_parallel.log import logger


@dataclass
class ProfileConfig:
    start_step: int = 0  # first profiled step (0 = no profiling)
    steps: int = 3  # steps in the window
    row_limit: int = 40  # operators listed in the table
    trace: bool = False  # also write a Chrome trace (large: tens of MB per step on a GPU)
    dir: str | None = None  # where the reports go (default: train.output_dir/profile)

    def errors(self) -> list[str]:
        errors = []
        if self.start_step < 0:
            errors.append(f"train.profile.start_step={self.start_step} must be >= 0 (0 = no profiling)")
        if self.steps < 1:
            errors.append(f"train.profile.steps={self.steps} must be >= 1")
        if self.row_limit < 1:
            errors.append(f"train.profile.row_limit={self.row_limit} must be >= 1")
        return errors


class StepProfiler:
    """Starts the profiler before step ``start_step`` and writes its reports after the window's last
    step (or when the run ends first) into ``<dir>/rank<R>_ops.txt`` (+ ``_trace.json``), ``dir`` by
    default ``out_dir/profile``."""

    def __init__(self, cfg: ProfileConfig, out_dir: Path, *, rank: int, device_type: str):
        self.cfg, self.rank = cfg, rank
        self.dir = Path(cfg.dir) if cfg.dir else out_dir / "profile"
        self.last = cfg.start_step + cfg.steps - 1
        self.on_device = device_type == "cuda"
        self._prof: profile | None = None

    def before(self, step: int) -> None:
        if self.cfg.start_step and step == self.cfg.start_step:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_device else [])
            self._prof = profile(activities=activities)
            self._prof.start()

    def after(self, step: int) -> None:
        if self._prof is not None and step == self.last:
            self.close()

    def close(self) -> None:
        """Stops a running window and writes its reports (a run shorter than the window writes what it saw)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        if self.on_device:
            torch.cuda.synchronize()
        prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        sort_by = "self_device_time_total" if self.on_device else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=self.cfg.row_limit, max_name_column_width=90)
        ops = self.dir / f"rank{self.rank}_ops.txt"
        ops.write_text(f"steps {self.cfg.start_step}..{self.last}, sorted by {sort_by}\n{table}\n")
        if self.cfg.trace:
            prof.export_chrome_trace(str(self.dir / f"rank{self.rank}_trace.json"))
        if self.rank == 0:
            logger.info("profile of steps %d..%d: %s", self.cfg.start_step, self.last, ops)
