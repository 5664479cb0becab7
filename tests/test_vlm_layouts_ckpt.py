"""Every VLM layout that trains also saves, resumes exactly and exports HF weights (torchrun,
2 gloo processes each): the encoder replicated (TP=1) inside the foundation's TP=2, the same with
parallel.encoder_layout=hetero_dp, PP=2, and PP=2 with parallel.encoder_layout=decoupled (the encoder
copied on both stages: one copy saved), and context parallelism CP=2 (each CP rank's RNG state
saved)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from loong_xpu.testing import launch_env

TESTS = Path(__file__).parent
LAYOUTS = {
    "etp1-in-tp2": ["parallel.tp=2", "model.image_encoder.tensor_model_parallel_size=1"],
    "hetero_dp": ["parallel.tp=2", "model.image_encoder.tensor_model_parallel_size=1",
                  "parallel.encoder_layout=hetero_dp"],
    "pp2": ["parallel.pp=2"],
    "decoupled": ["parallel.pp=2", "parallel.encoder_layout=decoupled"],
    "cp2": ["parallel.cp=2"],
}  # fmt: skip


@pytest.mark.dist
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vlm_layout_saves_resumes_and_exports_hf(layout, tmp_path, data_cache) -> None:
    out = tmp_path / "runs.json"
    overrides = [f"data.cache_dir={data_cache}", "train.tensorboard=false", "train.progress=false",
                 "train.global_batch_size=4", *LAYOUTS[layout]]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           str(TESTS / "vlm_resume_runs.py"), str(out), *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    paths = json.loads(out.read_text())
    rows = {k: [json.loads(x) for x in Path(paths[k]).read_text().splitlines()] for k in ("full", "resumed")}
    full = {r["step"]: r["loss"] for r in rows["full"] if r.get("split", "train") == "train"}
    resumed = {r["step"]: r["loss"] for r in rows["resumed"] if r.get("split", "train") == "train"}
    assert sorted(full) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == full[step], f"step {step}: resumed {resumed[step]} vs {full[step]}"
    hf = Path(paths["hf"])
    assert (hf / "config.json").is_file()
    names = set()
    for shard in hf.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            names |= set(f.keys())
    assert any("visual" in n for n in names) and any("embed_tokens" in n for n in names), sorted(names)[:10]
