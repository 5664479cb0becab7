"""The second VLM family in the train app: `train --config-name vlm model=tiny-qwen3-vl` (a one-line
swap from the default tiny-vlm) learns on the bundled real images and videos, its checkpoint exports
to an HF Qwen3-VL that transformers runs with Loong's logits, and TP=2 with sequence parallelism
(DeepStack features scattered like the embeddings) gives the single process's losses."""

from __future__ import annotations

import pytest
import torch

from loong_train.testing import make_runner

VLM = ["--config-name=vlm", "train.tensorboard=false", "train.progress=false", "train.eval_iters=1",
       "model=tiny-qwen3-vl"]  # fmt: skip
SHORT = [
    "train.steps=4",
    "train.eval_interval=0",
    "optim.schedule=constant",
    "optim.warmup_steps=0",
    "optim.lr=3e-3",
]


@pytest.fixture(scope="module")
def qwen3_vl_run(tmp_path_factory, data_cache):
    run = make_runner(tmp_path_factory.mktemp("qwen3-vl"), data_cache, defaults=VLM)
    return run, run(SHORT, name="single").check()


def _inputs(path) -> dict[str, torch.Tensor]:
    """The bundled photo + random text, with the tiny model's (chat tokenizer's) vision token ids."""
    from loong_ckpt.testing.hf_models import VLM_TOKENS, vlm_inputs
    from loong_models import load_model_config

    cfg = load_model_config("tiny-qwen3-vl")
    inputs = vlm_inputs(patch_size=16)
    ids = inputs["input_ids"]
    for key, token in VLM_TOKENS.items():
        ids = torch.where(ids == token, getattr(cfg, key), ids)
    inputs["input_ids"] = ids
    torch.save(inputs, path)
    return inputs


def test_qwen3_vl_job_learns_and_exports_to_transformers(qwen3_vl_run, tmp_path):
    from loong_ckpt import mcore_to_hf
    from loong_ckpt.testing import hf_vlm_logits, logits_in_process

    _, run = qwen3_vl_run
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert losses[4] < losses[1], f"loss did not fall: {losses}"
    ckpt = run.out_dir / "checkpoints" / "step_00000004"
    mcore_to_hf(ckpt, tmp_path / "hf", progress=False)
    inputs = _inputs(tmp_path / "inputs.pt")
    ref = hf_vlm_logits(tmp_path / "hf", inputs)  # transformers' Qwen3VLForConditionalGeneration
    ours = logits_in_process(ckpt, tmp_path / "inputs.pt")
    assert ours.shape == ref.shape and (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.dist
def test_tp2_sequence_parallel_matches_single_process(qwen3_vl_run):
    """torchrun, 2 processes, gloo: ViT, mergers (DeepStack ones included) and LLM split over 2 ranks,
    the sequence (and the DeepStack additions) scattered; same losses as one process."""
    run, single = qwen3_vl_run
    losses = (
        run([*SHORT, "parallel.tp=2", "parallel.sequence_parallel=true"], nproc=2, name="tp2")
        .check()
        .losses()
    )
    for step, loss in single.losses().items():
        assert abs(losses[step] - loss) <= 1e-4, f"step {step}: {losses[step]} vs single-process {loss}"
