"""ChunkPipe through the real train app (``parallel.chunkpipe.chunk_size``), in one torchrun
launch of 2 gloo processes (tests/chunkpipe_runs.py): on packed documents (THD, segments crossing
chunk boundaries) and on chat SFT (loss on the assistant's tokens), ChunkPipe across 2 pipeline
stages (and, on packed documents, at DP=2) has every step's loss, every parameter's gradient and
the evaluation loss of the unchunked PP=1 run (fp32, 1e-5); so does DeepSeek-V3-tiny (MLA, an
MoE layer with expert bias) at PP=2; the config refuses what it cannot combine with, naming the
key."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loong_train import testing
from loong_train.main import to_config
from loong_train.schema import ConfigError, validate
from loong_train.testing import TINY
from loong_xpu.testing import launch_env

TOL = 1e-5
# MoE routed per token, with expert bias (DeepSeek-V3's aux-loss-free balancing), no balancing loss
MOE_EXACT = ["model.foundation.moe.load_balancing=none", "model.foundation.moe.aux_loss_coeff=0.0"]
PACKED = "data.packing=thd;data.seq_length=96;data.thd.median_length=24;data.thd.strategy=sequential"
RUN_ONLY = ";".join(o for o in TINY if not o.startswith("model."))
# fp32, 3 steps of 2 micro-batches of one sample each, a final evaluation
COMMON = ("train.micro_batch_size=1;train.global_batch_size=2;train.dtype=fp32;train.steps=3;train.eval_interval=0;"
          "train.eval_iters=1;train.save_final=false")  # fmt: skip
DATA = {  # the tiny Llama on packed documents and on chat SFT, DeepSeek-V3 (MLA + MoE) on packed documents
    "packed": f"{';'.join(TINY)};{PACKED}",
    "sft": f"{';'.join(TINY)};phase=sft;model.foundation.vocab_size=8320;data.seq_length=64",
    "mla": f"{RUN_ONLY};model=deepseek-v3-tiny;{';'.join(MOE_EXACT)};{PACKED}",
}
CHUNKED = "parallel.chunkpipe.chunk_size=20"
# eval_iters counts micro-batches per DP rank: at PP=2 (DP=1) two of them are the DP=2 run's pair
PP2 = "parallel.pp=2;train.eval_iters=2"
LAYOUTS = {"ref": "", "pp2": PP2, "chunkpipe-dp2": CHUNKED, "chunkpipe-pp2": f"{CHUNKED};{PP2}"}
# (data, ChunkPipe layout, the unchunked run it reproduces). DeepSeek-V3-tiny's is the unchunked PP=2
# run: at PP=2 the second stage's layer starts from other weights than at PP=1 (this model's
# seed-only initialisation depends on the layout; the step-1 loss differs by ~6e-4, ChunkPipe or not)
CASES = [("packed", "chunkpipe-dp2", "ref"), ("packed", "chunkpipe-pp2", "ref"), ("sft", "chunkpipe-pp2", "ref"),
         ("mla", "chunkpipe-pp2", "pp2")]  # fmt: skip
RUNS = sorted({(d, lay) for d, *layouts in CASES for lay in layouts})


@pytest.fixture(scope="module")
def records(tmp_path_factory, data_cache) -> dict:
    out = tmp_path_factory.mktemp("chunkpipe") / "records.pt"
    specs = [f"{d}-{lay}=data.cache_dir={data_cache};{DATA[d]};{COMMON};{LAYOUTS[lay]}" for d, lay in RUNS]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
           str(Path(__file__).with_name("chunkpipe_runs.py")), str(out), *specs]  # fmt: skip
    proc = subprocess.run(cmd, cwd=out.parent, env=launch_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return torch.load(out)


@pytest.mark.dist
@pytest.mark.parametrize("data, layout, reference", CASES, ids=[f"{d}-{lay}" for d, lay, _ in CASES])
def test_chunkpipe_training_has_the_losses_and_gradients_of_the_unchunked_run(records, data, layout, reference):
    ref, got = records[f"{data}-{reference}"], records[f"{data}-{layout}"]
    assert len(got["losses"]) == len(ref["losses"]) == 3
    # steps 2 and 3 follow updates made from ChunkPipe's gradients
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"]), 1):
        assert b == pytest.approx(a, abs=TOL), (step, got["losses"], ref["losses"])
    for step, (a, b) in enumerate(zip(ref["grads"], got["grads"]), 1):
        if "output_layer.weight" in b and "output_layer.weight" not in a:
            # tied embeddings under PP: the last stage's output layer is a copy of the input
            # embedding, and megatron makes their gradients the embedding's whole gradient
            a = {**a, "output_layer.weight": a["embedding.word_embeddings.weight"]}
        assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=TOL, atol=TOL, msg=f"step {step}: {name}")
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], abs=TOL)


def compose_config(*overrides: str):
    return to_config(testing.compose_config(*overrides))


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["parallel.chunkpipe.chunk_size=0"], 1, r"parallel.chunkpipe.chunk_size=0 must be >= 1"),
        (["parallel.cp=2"], 2, r"parallel.chunkpipe cannot combine with parallel.cp > 1"),
        (["parallel.tp=2"], 2, r"parallel.chunkpipe cannot combine with parallel.tp > 1"),
        (["parallel.pp=2", "parallel.vpp=1", "model.foundation.num_layers=4"], 2,
         r"parallel.chunkpipe cannot combine with parallel.vpp"),
        (["train.micro_batch_size=2"], 1, r"parallel.chunkpipe cannot combine with train.micro_batch_size=2"),
        (["+model.foundation.recompute=full"], 1, r"cannot combine with model.foundation.recompute=full"),
        (["model=deepseek-v3-tiny"], 1, r"cannot combine with model.foundation.moe.load_balancing=seq_aux_loss"),
        (["model=deepseek-v3-tiny", *MOE_EXACT, "+model.foundation.moe.capacity_factor=1.0"], 1,
         r"cannot combine with model.foundation.moe.capacity_factor"),
        (["model=deepseek-v3-tiny", *MOE_EXACT, "parallel.ep=2"], 2, r"parallel.chunkpipe cannot combine with parallel.ep > 1"),
        (["model=deepseek-v32-tiny"], 1, r"parallel.chunkpipe cannot combine with model.foundation.sparse_attention"),
    ],
    ids=["chunk-size", "cp", "tp", "vpp", "micro-batch", "recompute", "moe-balancing-loss", "moe-token-dropping",
         "ep", "dsa"],
)
def test_chunkpipe_config_errors_name_what_cannot_combine(overrides, world, message):
    cfg = compose_config("parallel.chunkpipe.chunk_size=16", "train.micro_batch_size=1", *overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=world)
