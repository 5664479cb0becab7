"""Where a run's numbers go: a JSONL file, TensorBoard, and the progress bar; and the window of
steps whose throughput a record reports."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loong_data.step_data import StepCounts


class MetricsWriter:
    """Appends one JSON object per record to ``metrics.jsonl`` and mirrors scalars to TensorBoard.
    Only the main rank writes; other ranks get a writer whose methods do nothing."""

    def __init__(self, out_dir: Path, *, enabled: bool, tensorboard: bool, resume_step: int = 0):
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self.tb_dir = out_dir / "tensorboard"
        self._file = None
        self._tb = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step and self.path.exists():
            # Drop records past the checkpoint we resume from: they belong to the lost tail of
            # the interrupted run and will be produced again.
            kept = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= resume_step]
            self.path.write_text("".join(k + "\n" for k in kept))
        elif self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - lives until close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.tb_dir), purge_step=resume_step + 1 if resume_step else None)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float):
                    self._tb.add_scalar(f"{record.get('split', 'train')}/{k}", v, step)

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb:
            self._tb.close()


def progress_bar(total: int, initial: int, enabled: bool) -> tqdm:
    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True, desc="train")


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

    def record(self, step: int, result, *, world_size: int, peak_flops: float | None) -> tuple[dict, dict]:
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
