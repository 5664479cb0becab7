"""The online cost refit happens when it says it does, learns the measured cost, and so changes
the plan: a claim that only a one-off benchmark backed before."""

import numpy as np

from loong_parallel.balance import OnlineCostFit, QuadraticCost, plan_balance
from loong_parallel.balance.assign import imbalance, rank_loads

# The FLOP model of a small model says attention is cheap (b/a ~ 1e-4 per token) ...
INITIAL = QuadraticCost.from_flops(num_parameters=1_000_000, num_layers=2, attention_width=64)
# ... while the measured seconds grow mostly with L^2 (e.g. an unfused attention on a slow device).
TRUE = QuadraticCost(a=1e-6, b=1e-7, c=1e-4)
# one long document and short ones on 2 ranks: the near-linear FLOP model gives the long one's
# rank as many tokens as the other; the measured, quadratic cost keeps short ones away from it
BATCH = np.array([800] + [200] * 4 + [100] * 8, dtype=np.float64)
ORIGIN = np.arange(len(BATCH)) % 2


def _measured(lengths: np.ndarray, step: int) -> float:
    noise = 1 + 0.01 * np.sin(step)  # deterministic jitter: a fit, not an echo
    return float(TRUE(lengths).sum() * noise + 2e-3)  # + a per-step intercept every rank pays


def test_refit_happens_on_schedule_learns_the_measured_cost_and_changes_the_plan(megatron_cpu):
    fit = OnlineCostFit(INITIAL, warmup_steps=2, interval=3, window=50)
    rng = np.random.default_rng(0)
    refits = []
    for step in range(1, 12):
        lengths = rng.integers(16, 1024, size=rng.integers(2, 9)).astype(np.float64)
        if fit.observe(lengths, _measured(lengths, step)) is not None:
            refits.append(step)
    assert refits == [5, 8, 11]  # after 2 warm-up steps, every 3rd step
    # from the FLOP model's attention share (b/a ~ 1e-4) to the measured one (0.1), within noise
    assert INITIAL.scaled().b < 2e-4 and TRUE.scaled().b / 3 < fit.cost.scaled().b < TRUE.scaled().b * 3

    before = plan_balance(BATCH, ORIGIN, 2, INITIAL, min_imbalance=0.0)
    after = plan_balance(BATCH, ORIGIN, 2, fit, min_imbalance=0.0)
    assert not np.array_equal(before.assignment, after.assignment)
    # judged by the true cost, the refitted plan is the better one
    true_costs = TRUE(BATCH)
    true_before = imbalance(rank_loads(true_costs, before.assignment, 2))
    true_after = imbalance(rank_loads(true_costs, after.assignment, 2))
    assert true_after < true_before - 0.05, (true_before, true_after)


def test_no_refit_during_warm_up_or_between_intervals(megatron_cpu):
    fit = OnlineCostFit(INITIAL, warmup_steps=3, interval=10)
    lengths = np.array([100.0, 200.0])
    assert all(fit.observe(lengths, _measured(lengths, s)) is None for s in range(1, 13))
    assert fit.cost is INITIAL
