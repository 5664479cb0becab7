"""The DeepSeek-V3.2-style tiny model (MLA + DeepSeek sparse attention) through the real train
app on CPU: the loss falls, with an MTP layer too (its loss falls), and a TP=2 + sequence-parallel run (2 processes, gloo) reproduces the
single-process losses from the same initial weights."""

import pytest

from loong_train.testing import TINY, make_runner

# model=deepseek-v32-tiny at sequence 128, so index_topk=64 really drops keys
DSA = ["model=deepseek-v32-tiny", "data.seq_length=128"] + [
    o for o in TINY if not o.startswith(("model.", "data.seq_length"))
]
STEPS = 4
TOL = 1e-4


@pytest.fixture
def run_dsa(tmp_path, data_cache):
    return make_runner(tmp_path, data_cache, defaults=DSA)


def test_tiny_dsa_model_trains_and_loss_falls(run_dsa):
    run = run_dsa(["train.steps=20", "optim.lr=1e-2", "train.eval_interval=0"]).check()
    losses = run.losses()
    assert sorted(losses) == list(range(1, 21))
    assert losses[20] < losses[1] - 1.0, f"loss did not fall enough: {losses[1]:.3f} -> {losses[20]:.3f}"
    assert "model deepseek-v32" in run.stderr


def test_tiny_dsa_model_trains_with_an_mtp_layer_and_its_loss_falls(run_dsa):
    """DeepSeek-V3.2's layout: the MTP layer is a DSA layer with its own indexer."""
    from loong_ckpt.mcore_io import read_metadata

    run = run_dsa(
        ["train.steps=8", "optim.lr=1e-2", "train.eval_interval=0", "model.foundation.mtp_num_layers=1"]
    )
    records = run.check().records("train")
    mtp = [r["mtp_loss"] for r in records]
    assert len(mtp) == 8 and all(0 < x < 20 for x in mtp)  # the MTP layer's cross-entropy, every step
    assert mtp[-1] < mtp[0] - 1.0, f"MTP loss did not fall: {mtp[0]:.3f} -> {mtp[-1]:.3f}"
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    keys = set(read_metadata(run.out_dir / "checkpoints" / "step_00000008"))
    indexer = "mtp.layers.0.transformer_layer.self_attention.core_attention.indexer."
    assert {
        "mtp.layers.0.eh_proj.weight",
        indexer + "linear_wk.weight",
        indexer + "linear_wq_b.weight",
    } <= keys


@pytest.mark.dist
def test_tp2_sequence_parallel_matches_single_process(run_dsa):
    # megatron's AbsorbedMLASelfAttention requires sequence parallelism when TP > 1
    init = run_dsa(["train.steps=0"], name="init").check()
    common = [f"train.init_from={init.out_dir / 'checkpoints' / 'step_00000000'}", f"train.steps={STEPS}",
              "train.eval_interval=0"]  # fmt: skip
    single = run_dsa(common, name="single").check().losses()
    tp2 = run_dsa([*common, "parallel.tp=2", "parallel.sequence_parallel=true"], nproc=2, name="tp2").check()
    losses = tp2.losses()
    assert sorted(losses) == sorted(single) and len(single) == STEPS
    for step, loss in single.items():
        assert abs(losses[step] - loss) <= TOL, f"step {step}: {losses[step]} vs single-process {loss}"
