"""parallel.cuda_graphs=local on a GPU: the train app with megatron's per-layer CUDA graphs gives
the eager run's losses (graphs captured after 3 warm-up steps and replayed after), and the
evaluation passes in between run the layers eagerly without breaking the captured graphs."""

import pytest
import torch

from loong_models.specs import te_installed


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not te_installed(), reason="needs CUDA and transformer-engine"
)
def test_cuda_graphs_train_to_the_eager_losses_with_evaluation_in_between(runner_factory, tmp_path):
    run_train = runner_factory(tmp_path)
    init = run_train(["train.steps=0"], name="init").check().out_dir / "checkpoints" / "step_00000000"
    common = [f"train.init_from={init}", "train.steps=8", "train.dtype=fp32", "train.eval_interval=2",
              "train.eval_iters=1", "model.layer_backend=te"]  # fmt: skip
    eager = run_train(common, name="eager", device="cuda").check()
    graphs = run_train([*common, "parallel.cuda_graphs=local"], name="graphs", device="cuda").check()
    assert "cuda graph(s)" in graphs.stderr and "cuda graph(s)" not in eager.stderr  # megatron's capture log
    for step, loss in eager.losses().items():  # steps 4..8 replay the graphs captured after step 3
        assert abs(graphs.losses()[step] - loss) <= 1e-4, (
            f"step {step}: {graphs.losses()[step]} vs eager {loss}"
        )
    evals, eager_evals = graphs.records("val"), eager.records("val")
    assert len(evals) >= 4 and [r["step"] for r in evals] == [r["step"] for r in eager_evals]
    assert [r["loss"] for r in evals] == pytest.approx([r["loss"] for r in eager_evals], abs=1e-4)
