"""DP load balancing: cost model, fit, assignment properties, planning."""

import numpy as np
import pytest

from loong_parallel.balance import (
    CapInfeasible,
    QuadraticCost,
    balance_assignment,
    fit_quadratic_cost,
    imbalance,
    keep_local,
    plan_balance,
    rank_loads,
    segment_features,
)


def long_tail_lengths(rng: np.random.Generator, n: int, *, median: float = 600, max_length: int = 16384) -> np.ndarray:
    """Lognormal lengths plus 3% at the maximum: mostly short text, a few very long samples."""
    lengths = np.clip(np.rint(median * np.exp(rng.standard_normal(n))), 16, max_length)
    lengths[rng.random(n) < 0.03] = max_length
    return lengths.astype(np.int64)


COST = QuadraticCost.from_flops(num_parameters=500_000_000, num_layers=24, attention_width=1024)


def test_flop_cost_coefficients() -> None:
    cost = QuadraticCost.from_flops(num_parameters=1000, num_layers=2, attention_width=8)
    assert (cost.a, cost.b, cost.c) == (6000.0, 96.0, 0.0)
    assert cost(np.array([10, 20])).tolist() == [6000 * 10 + 96 * 100, 6000 * 20 + 96 * 400]
    assert cost(np.array([[10, 7]])).tolist() == [6000 * 10 + 96 * 100]  # column 0 = tokens
    with pytest.raises(ValueError):
        QuadraticCost(-1.0, 1.0)


def test_fit_recovers_coefficients_and_drops_the_per_step_intercept() -> None:
    rng = np.random.default_rng(0)
    truth = QuadraticCost(2e-6, 3e-9, 1e-4)
    rows, times = [], []
    for _ in range(60):
        segments = long_tail_lengths(rng, int(rng.integers(4, 20)), median=300, max_length=4096)
        rows.append(segment_features(segments))
        times.append(float(truth(segments).sum()) + 0.05 * (1 + 0.01 * rng.standard_normal()))
    fit = fit_quadratic_cost(np.array(rows), np.array(times))
    assert fit is not None
    assert fit.a == pytest.approx(truth.a, rel=0.1) and fit.b == pytest.approx(truth.b, rel=0.1)
    assert min(fit.a, fit.b, fit.c) >= 0
    # Times that say nothing about length give no usable model.
    assert fit_quadratic_cost(np.array(rows), np.zeros(len(rows))) is None


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_balancing_long_tail_reaches_target_where_naive_is_far_off(dp: int) -> None:
    rng = np.random.default_rng(dp)
    naive, balanced = [], []
    for _ in range(5):
        lengths = long_tail_lengths(rng, 64 * dp)
        costs = COST(lengths)
        origin = np.repeat(np.arange(dp), 64)
        cap = int(lengths.sum() / dp * 1.5)
        assignment = balance_assignment(costs, lengths, dp, max_tokens=cap)
        assert assignment.shape == lengths.shape and set(assignment.tolist()) <= set(range(dp))
        assert np.bincount(assignment, weights=lengths, minlength=dp).max() <= cap
        naive.append(imbalance(rank_loads(costs, origin, dp)))
        balanced.append(imbalance(rank_loads(costs, assignment, dp)))
    assert max(balanced) <= 0.05
    assert np.mean(naive) >= 0.1


def test_assignment_is_deterministic_and_respects_a_tight_cap() -> None:
    lengths = long_tail_lengths(np.random.default_rng(7), 256)
    costs = COST(lengths)
    cap = int(np.ceil(lengths.sum() / 4)) + int(lengths.max())
    a = balance_assignment(costs, lengths, 4, max_tokens=cap)
    assert np.array_equal(a, balance_assignment(costs, lengths, 4, max_tokens=cap))
    assert np.bincount(a, weights=lengths, minlength=4).max() <= cap
    with pytest.raises(CapInfeasible, match="fits on no rank"):
        balance_assignment(costs, lengths, 4, max_tokens=int(lengths.max()) - 1)


def test_refinement_beats_plain_lpt_on_a_known_case() -> None:
    # The classic LPT worst case: 3,3,2,2,2 on two ranks is 3+2+2 | 3+2 (7 vs 5) for LPT; the
    # optimum 3+3 | 2+2+2 (6 vs 6) needs a swap.
    costs = np.array([3.0, 3.0, 2.0, 2.0, 2.0])
    lpt_only = balance_assignment(costs, np.ones(5), 2, max_rounds=0)
    refined = balance_assignment(costs, np.ones(5), 2)
    assert rank_loads(costs, lpt_only, 2).max() == 7.0
    assert rank_loads(costs, refined, 2).max() == 6.0


def test_keep_local_relabels_ranks_without_changing_loads() -> None:
    origin = np.array([0, 0, 1, 1, 2, 2])
    assignment = np.array([2, 2, 0, 0, 1, 1])  # the same grouping, other labels
    tokens = np.ones(6)
    assert keep_local(assignment, origin, tokens, 3).tolist() == origin.tolist()


def test_plan_is_a_no_op_when_already_balanced() -> None:
    lengths = np.full(32, 512)
    origin = np.repeat(np.arange(4), 8)
    plan = plan_balance(lengths, origin, 4, COST, min_imbalance=0.05)
    assert plan.skipped == "small" and np.array_equal(plan.assignment, origin)
    skewed = np.concatenate([np.full(8, 4096), np.full(24, 64)])
    plan = plan_balance(skewed, origin, 4, COST, min_imbalance=0.05)
    assert plan.skipped is None and plan.naive_imbalance > 1.0 and plan.imbalance < plan.naive_imbalance
    # Every sample of the global batch has exactly one rank.
    assert plan.assignment.shape == (32,) and plan.assignment.min() >= 0 and plan.assignment.max() < 4
    capped = plan_balance(skewed, origin, 4, COST, max_tokens=4000)
    assert capped.skipped == "cap"
