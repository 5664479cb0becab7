"""Where a run's numbers go in its output directory: ``metrics.jsonl`` (one JSON object per
record) and TensorBoard. A resumed run is the same run continuing: it keeps the records up to the
checkpoint it resumes from and replaces the rest (run_dir.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loong_ckpt.run_dir import METRICS_FILE, TENSORBOARD_DIR


class MetricsWriter:
    """Appends one JSON object per record to ``metrics.jsonl`` and mirrors scalars to TensorBoard.
    Only the main rank writes; other ranks get a writer whose methods do nothing."""

    def __init__(self, out_dir: Path, *, enabled: bool, tensorboard: bool, resume_step: int = 0):
        self.enabled = enabled
        self.path = out_dir / METRICS_FILE
        self.tb_dir = out_dir / TENSORBOARD_DIR
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
