"""Test helpers of loong-ckpt, importable by any test: tiny HF models made with transformers
(:mod:`loong_ckpt.testing.hf_models`), their converted checkpoints and reference logits, and Loong
logits at a TP / PP / EP layout (:mod:`loong_ckpt.testing.parity_worker`, under torchrun).
Needs the test dependencies (pytest, transformers)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from loong_ckpt.testing.hf_models import (
    hf_logits,
    hf_vlm_logits,
    make_hf_model,
    make_hf_qwen3_vl,
    make_hf_vlm,
    vlm_inputs,
)
from loong_xpu.testing import launch_env

FAMILIES = ("llama", "qwen2", "qwen3")
MOE_FAMILIES = ("qwen3-moe", "deepseek-v3")  # checked at EP=2 (not TP/PP) under torchrun
TIED = {"qwen3"}  # one family with tied embeddings covers that path (no output_layer key)


@dataclass
class Converted:
    family: str
    hf: Path
    ckpt: Path
    tokens: Path  # token ids [batch, seq], or a VLM's input dict (input_ids, pixel_values, image_grid_thw)
    ref: torch.Tensor  # HF logits for the tokens


def run_workers(
    jobs: list[tuple[Path, Path, Path]], *, tp: int, pp: int, ep: int = 1, read_log: Path | None = None,
    encoder_tp: int | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """Loong logits of each (source, tokens, out) job at TP x PP (x EP), in one torchrun launch;
    ``read_log``: a directory where each rank lists the HF tensors it read; ``encoder_tp``: a VLM
    image encoder's own TP size."""
    layout = dict(tp=tp, pp=pp, ep=ep, encoder_tp=encoder_tp)
    return run_layouts([dict(source=str(s), tokens=str(t), out=str(o), **layout) for s, t, o in jobs],
                       read_log=read_log)  # fmt: skip


def run_layouts(jobs: list[dict], *, read_log: Path | None = None) -> list[torch.Tensor]:
    """Loong logits of each job ``{source, tokens, out, tp, pp[, ep, encoder_tp]}`` in one torchrun
    launch (importing megatron costs ~10 s per process): every layout must use the same world size."""
    worlds = {j["tp"] * j["pp"] * j.get("ep", 1) for j in jobs}
    assert len(worlds) == 1, f"one launch runs one world size, the jobs ask for {sorted(worlds)}"
    jobs_file = Path(jobs[0]["out"]).with_name(Path(jobs[0]["out"]).stem + "-jobs.json")
    jobs_file.write_text(json.dumps(jobs))
    script = ["-m", "loong_ckpt.testing.parity_worker", "--jobs-file", str(jobs_file)]
    script += ["--read-log", str(read_log)] if read_log else []
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={worlds.pop()}"]
    proc = subprocess.run([*launcher, *script], env=launch_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(j["out"]) for j in jobs]


def logits_in_process(source: Path, tokens: Path) -> torch.Tensor:
    """Loong logits at TP = PP = 1 in this process (a world of one, torn down afterwards)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from loong_ckpt.mcore_io import _single_process_megatron
    from loong_ckpt.testing.parity_worker import loong_logits

    with _single_process_megatron():
        model_parallel_cuda_manual_seed(0)
        return loong_logits(source, torch.load(tokens))


_CONVERTED: dict[str, Converted] = {}


def get_converted(tmp_path_factory, family: str) -> Converted:
    """The family's tiny HF model, its Loong checkpoint and reference logits, made once per session."""
    from loong_ckpt import hf_to_mcore

    if family not in _CONVERTED:
        base = tmp_path_factory.mktemp(family)
        # small shards: the index / multi-file path is exercised too
        hf = make_hf_model(base / "hf", family, tie=family in TIED, max_shard_size="200KB")
        hf_to_mcore(hf, base / "ckpt", progress=False)
        torch.manual_seed(0)
        tokens = torch.randint(0, 1000, (2, 24))
        torch.save(tokens, base / "tokens.pt")
        _CONVERTED[family] = Converted(family, hf, base / "ckpt", base / "tokens.pt", hf_logits(hf, tokens))
    return _CONVERTED[family]


def get_converted_vlm(tmp_path_factory) -> Converted:
    """The tiny Qwen2.5-VL, its Loong checkpoint and HF's logits on a real image + text, made once."""
    from loong_ckpt import hf_to_mcore

    if "qwen2.5-vl" not in _CONVERTED:
        base = tmp_path_factory.mktemp("qwen2.5-vl")
        hf = make_hf_vlm(base / "hf", max_shard_size="100KB")
        hf_to_mcore(hf, base / "ckpt", progress=False)
        inputs = vlm_inputs()
        torch.save(inputs, base / "inputs.pt")
        _CONVERTED["qwen2.5-vl"] = Converted("qwen2.5-vl", hf, base / "ckpt", base / "inputs.pt",
                                             hf_vlm_logits(hf, inputs))  # fmt: skip
    return _CONVERTED["qwen2.5-vl"]


def get_converted_qwen3_vl(tmp_path_factory) -> Converted:
    """The tiny Qwen3-VL, its Loong checkpoint and HF's logits on a real image + text, made once."""
    from loong_ckpt import hf_to_mcore

    if "qwen3-vl" not in _CONVERTED:
        base = tmp_path_factory.mktemp("qwen3-vl")
        hf = make_hf_qwen3_vl(base / "hf", max_shard_size="100KB")
        hf_to_mcore(hf, base / "ckpt", progress=False)
        inputs = vlm_inputs(patch_size=16)
        torch.save(inputs, base / "inputs.pt")
        _CONVERTED["qwen3-vl"] = Converted("qwen3-vl", hf, base / "ckpt", base / "inputs.pt",
                                           hf_vlm_logits(hf, inputs))  # fmt: skip
    return _CONVERTED["qwen3-vl"]


class DictReader:
    """An in-memory HF tensor source (mapping.SliceReader) for per-rank slicing tests."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name, dim=None, start=0, stop=None):
        t = self.tensors[name]
        return (
            t if dim is None else t.narrow(dim, start, (stop if stop is not None else t.shape[dim]) - start)
        )
