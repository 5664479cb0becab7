"""ChunkPipe through the real train app (``parallel.chunkpipe.chunk_size``): on packed documents
(THD, segments crossing chunk boundaries) and on chat SFT (loss on the assistant's tokens), every
step's loss and the evaluation loss equal the unchunked run's (fp32); the config refuses what it
cannot combine with, naming the key."""

import pytest
from hydra import compose, initialize_config_module

from loong_train.main import to_config
from loong_train.schema import ConfigError, validate

RUN = ["train.micro_batch_size=1", "train.global_batch_size=2", "train.dtype=fp32", "train.steps=3",
       "train.eval_interval=0", "train.eval_iters=1", "train.save_final=false"]  # fmt: skip
DATA = {
    "packed": ["data.packing=thd", "data.seq_length=96", "data.thd.median_length=24", "data.thd.strategy=sequential"],
    "sft": ["phase=sft", "model.foundation.vocab_size=8320", "data.seq_length=64"],
}


@pytest.mark.parametrize("data", ["packed", "sft"])
def test_chunkpipe_training_has_the_losses_of_the_unchunked_run(run_train, data):
    plain = run_train([*DATA[data], *RUN], name=f"{data}-plain").check()
    chunked = run_train([*DATA[data], *RUN, "parallel.chunkpipe.chunk_size=20"], name=f"{data}-chunked").check()
    assert "ChunkPipe: chunks of 20 tokens" in chunked.stderr + chunked.stdout
    ref, got = plain.losses(), chunked.losses()
    assert sorted(got) == sorted(ref) == [1, 2, 3]
    for step in ref:  # step 2 and 3 follow updates made from ChunkPipe's gradients
        assert got[step] == pytest.approx(ref[step], abs=1e-5), (step, got, ref)
    (ref_val,), (got_val,) = ([r["loss"] for r in run.records("val")] for run in (plain, chunked))
    assert got_val == pytest.approx(ref_val, abs=1e-5)


def compose_config(*overrides: str):
    with initialize_config_module("loong_train.configs", version_base=None):
        return to_config(compose("config", overrides=list(overrides)))


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
        (["model=deepseek-v3-tiny"], 1, r"parallel.chunkpipe cannot combine with an MoE model"),
    ],
    ids=["chunk-size", "cp", "tp", "vpp", "micro-batch", "recompute", "moe"],
)
def test_chunkpipe_config_errors_name_what_cannot_combine(overrides, world, message):
    cfg = compose_config("parallel.chunkpipe.chunk_size=16", "train.micro_batch_size=1", *overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=world)
