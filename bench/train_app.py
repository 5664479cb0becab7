"""Run the real train app as a benchmark subject: one place that launches it, fails loudly with its
stderr, echoes its model line and reads back the training steps' metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_train_app(cmd: list[str], out: Path, *, label: str, env: dict[str, str] | None = None) -> list[dict]:
    """Run ``cmd`` (a train-app command writing to ``out``); return its training-step rows of
    ``out/metrics.jsonl``. Exits naming ``label`` when the run fails. A benchmark re-run replaces
    its previous output (``train.overwrite=true``)."""
    proc = subprocess.run([*cmd, "train.overwrite=true"], capture_output=True, text=True, env=env)
    if proc.returncode:
        print(proc.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"{label} failed ({proc.returncode})")
    # the model line, and loong_kernels' warnings (a fused op on its slow torch reference)
    shown = [ln for ln in proc.stderr.splitlines() if "loong_train: model" in ln or "WARNING loong_kernels" in ln]
    print("  ", *shown, sep="\n   " if len(shown) > 1 else " ", flush=True)
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split", "train") == "train"]
