"""Run the real `train` app in fresh processes (one process, or several under torchrun with
gloo) and read back what it wrote; compose its Hydra config in-process. Shared by the
cross-package tests."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from loong_xpu.testing import launch_env

# A ~0.1M-parameter model and short sequences: a step takes milliseconds on a 2-core CPU.
TINY = [
    "model.foundation.num_layers=2",
    "model.foundation.hidden_size=64",
    "model.foundation.ffn_hidden_size=128",
    "model.foundation.num_attention_heads=4",
    "model.foundation.num_query_groups=2",
    "model.foundation.kv_channels=16",
    "data.seq_length=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.eval_iters=1",
    "train.tensorboard=false",
    "train.progress=false",
    "optim.warmup_steps=2",
]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    out_dir: Path

    def records(self, split: str | None = None) -> list[dict]:
        path = self.out_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        return [r for r in rows if split is None or r.get("split", "train") == split]

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records("train")}

    def check(self) -> Run:
        assert self.returncode == 0, f"train failed ({self.returncode}):\n{self.stderr[-4000:]}"
        return self


def compose_config(*overrides: str, preset: str = "config") -> DictConfig:
    """The train app's Hydra config ``preset`` (``config``: the default job) with ``overrides``,
    before its schema check (``loong_train.main.to_config``)."""
    with initialize_config_module("loong_train.configs", version_base=None):
        return compose(preset, overrides=list(overrides))


def load_script(path: Path, name: str | None = None) -> ModuleType:
    """Import the script at ``path`` (e.g. a ``bench/`` script, which is not a package) as module
    ``name`` (default: the file's stem; pass another where the stem is an installed package's name),
    registered in ``sys.modules`` so its dataclasses and pickles resolve."""
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python script")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def train_command(overrides: list[str], nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "loong_train", *overrides]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--standalone", "-m", "loong_train", *overrides,
    ]  # fmt: skip


def make_runner(base: Path, data_cache: Path, defaults: list[str] = TINY):
    """runner(overrides, nproc=1, name="run") -> Run, writing into base/name; ``defaults`` come
    before ``overrides`` (TINY: a tiny Llama-style model and short runs)."""

    def _run(overrides: list[str], nproc: int = 1, name: str = "run", timeout: float = 600, device: str = "cpu") -> Run:
        out = base / name
        args = [*defaults, f"data.cache_dir={data_cache}", f"train.output_dir={out}", *overrides]
        proc = subprocess.run(
            train_command(args, nproc), cwd=base, env=launch_env(device),
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        return Run(proc.returncode, proc.stdout, proc.stderr, out)

    return _run
