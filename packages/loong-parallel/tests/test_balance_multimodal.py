"""DP load balancing of VLM samples: the cost counts the ViT's patches (window and full-attention
layers) next to the LLM's tokens, and its online refit from measured times changes the plan."""

import os

import numpy as np
import pytest
import torch.distributed as dist

from loong_parallel.balance import (
    MultimodalCost,
    OnlineCostFit,
    QuadraticCost,
    imbalance,
    plan_balance,
    rank_loads,
    vision_sizes,
)

LLM = QuadraticCost.from_flops(num_parameters=1000, num_layers=2, attention_width=8)


def test_vision_sizes_count_patches_and_squared_frames() -> None:
    # an image of 4x6 patches and a video of 2 frames of 2x2 patches
    assert vision_sizes([(1, 4, 6), (2, 2, 2)]) == (24 + 8, 24**2 + 2 * 4**2)
    assert vision_sizes([]) == (0, 0)


def test_flop_cost_adds_window_and_full_attention_layers() -> None:
    cost = MultimodalCost.from_flops(LLM, vision_parameters=500, vision_layers=4, full_attention_layers=1,
                                     vision_width=16, window_patches=64)  # fmt: skip
    assert cost.patch == 6 * 500 + 12 * 3 * 16 * 64
    assert cost.frame_sq == 12 * 1 * 16
    sizes = np.array([[10, 0, 0], [10, 24, 576]], dtype=np.float64)
    text = float(LLM(np.array([10]))[0])
    assert cost(sizes).tolist() == [text, text + cost.patch * 24 + cost.frame_sq * 576]
    assert cost(np.array([10.0])).tolist() == [text]  # 1-D sizes: text only


def test_fit_recovers_the_vision_coefficients() -> None:
    rng = np.random.default_rng(0)
    truth = MultimodalCost(QuadraticCost(2e-6, 1e-9, 1e-4), 5e-6, 2e-9)
    rows, times = [], []
    for _ in range(80):
        segments = rng.integers(50, 2000, size=int(rng.integers(2, 6)))
        grids = [(1, int(rng.integers(2, 40)), int(rng.integers(2, 40))) for _ in range(int(rng.integers(0, 8)))]
        patches, frame_sq = vision_sizes(grids)
        rows.append(MultimodalCost.features((segments, patches, frame_sq)))
        times.append(float(truth.llm(segments).sum()) + truth.patch * patches + truth.frame_sq * frame_sq + 0.05)
    fit = MultimodalCost.fit(np.array(rows), np.array(times))
    assert fit is not None
    for got, want in zip(fit.coefficients(), truth.coefficients()):
        assert got == pytest.approx(want, rel=0.05, abs=1e-12)


@pytest.fixture
def one_process_group():
    """A real one-rank gloo group (OnlineCostFit all-gathers and broadcasts over it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_refit_from_measured_times_changes_the_plan(one_process_group) -> None:
    """FLOPs say an image costs about a fifth of a 600-token sample; the measured times say the
    ViT is 50x slower than its FLOPs: after the refit the image samples are split over both ranks
    and the plan's true imbalance drops from 65% to 17% (the best split of these five samples)."""
    flops = MultimodalCost.from_flops(LLM, vision_parameters=100, vision_layers=2, full_attention_layers=1,
                                      vision_width=8, window_patches=16)  # fmt: skip
    slow_vit = MultimodalCost(flops.llm, flops.patch * 50, flops.frame_sq * 50)
    fit = OnlineCostFit(flops, warmup_steps=2, interval=20, window=50)
    # a global batch: one long text sample, four short samples with an image each
    sizes = np.array([[1800, 0, 0], *[[600, *vision_sizes([(1, 16, 16)])]] * 4], dtype=np.float64)
    origin = np.array([0, 0, 1, 1, 1])
    before = plan_balance(sizes, origin, 2, fit, min_imbalance=0.05)
    rng = np.random.default_rng(1)
    refitted = []
    for _ in range(22):
        segments = rng.integers(100, 900, size=int(rng.integers(1, 5)))
        patches, frame_sq = vision_sizes([(1, int(rng.integers(4, 20)), int(rng.integers(4, 20)))
                                          for _ in range(int(rng.integers(0, 4)))])  # fmt: skip
        seconds = float(slow_vit(np.array([[s, 0, 0] for s in segments]).astype(float)).sum())
        seconds += slow_vit.patch * patches + slow_vit.frame_sq * frame_sq
        refitted.append(fit.observe((segments, patches, frame_sq), seconds * 1e-9 + 0.01))
    assert fit.refits == 1 and refitted[-1] is fit.cost and all(r is None for r in refitted[:-1])
    image_over_text = lambda cost: cost(sizes[1:2])[0] / cost(sizes[:1])[0]  # noqa: E731
    assert image_over_text(fit.cost) == pytest.approx(image_over_text(slow_vit), rel=0.05)
    assert image_over_text(fit.cost) > 3 * image_over_text(flops)
    after = plan_balance(sizes, origin, 2, fit, min_imbalance=0.05)
    assert before.assignment.tolist() == [0, 1, 1, 1, 1] and after.assignment.tolist() == [0, 0, 1, 0, 1]
    true_imbalance = lambda plan: imbalance(rank_loads(slow_vit(sizes), plan.assignment, 2))  # noqa: E731
    assert true_imbalance(before) > 0.6 and true_imbalance(after) < 0.2  # the best split of 5 samples
