"""The DeepSeek-V3.2-style tiny model (MLA + DeepSeek sparse attention) through the real train
app on CPU: the loss falls, and a TP=2 + sequence-parallel run (2 processes, gloo) reproduces the
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
