"""Assign the samples of a global batch to data-parallel ranks so that the most loaded rank's
cost is as small as possible, under a per-rank token cap.

Longest-processing-time first (LPT: costliest sample first, each to the least loaded rank that
still has room; at most 4/3 of optimal), then local search on the most loaded rank: the single
move or pairwise swap with another rank that lowers the pair's maximum the most, repeated until
none helps. Pure and deterministic: ties break by sample index and rank number.
"""

from __future__ import annotations

import numpy as np


class CapInfeasible(ValueError):
    """No rank has room for a sample under the token cap."""


def rank_loads(costs: np.ndarray, assignment: np.ndarray, num_ranks: int) -> np.ndarray:
    return np.bincount(assignment, weights=np.asarray(costs, dtype=np.float64), minlength=num_ranks)


def imbalance(loads: np.ndarray) -> float:
    """``max / mean - 1`` (0 is perfect)."""
    mean = float(np.mean(loads))
    return float(np.max(loads)) / mean - 1.0 if mean > 0 else 0.0


def _lpt(costs: np.ndarray, tokens: np.ndarray, num_ranks: int, cap: float) -> np.ndarray:
    order = np.lexsort((np.arange(len(costs)), -tokens, -costs))  # last key sorts first
    loads = np.zeros(num_ranks)
    used = np.zeros(num_ranks)
    assignment = np.empty(len(costs), dtype=np.int64)
    for i in order:
        room = used + tokens[i] <= cap
        if not room.any():
            raise CapInfeasible(f"sample {i} ({int(tokens[i])} tokens) fits on no rank under the cap of "
                                f"{int(cap)} tokens (ranks hold {used.astype(int).tolist()})")
        r = int(np.argmin(np.where(room, loads, np.inf)))
        assignment[i] = r
        loads[r] += costs[i]
        used[r] += tokens[i]
    return assignment


def _best_step(costs, tokens, assignment, loads, used, cap, m):
    """The move/swap from rank ``m`` that most lowers ``max(load_m, load_r)``, or None."""
    mine = np.flatnonzero(assignment == m)
    best_peak, best = loads[m] * (1 - 1e-12), None
    for r in range(len(loads)):
        if r == m:
            continue
        # Move sample i: m -> r.
        peak = np.maximum(loads[m] - costs[mine], loads[r] + costs[mine])
        peak = np.where(used[r] + tokens[mine] <= cap, peak, np.inf)
        if len(mine):
            k = int(np.argmin(peak))
            if peak[k] < best_peak:
                best_peak, best = peak[k], (mine[k], r, None)
        # Swap i (on m) with j (on r).
        theirs = np.flatnonzero(assignment == r)
        if not len(mine) or not len(theirs):
            continue
        delta = costs[mine][:, None] - costs[theirs][None, :]
        dtok = tokens[mine][:, None] - tokens[theirs][None, :]
        peak = np.maximum(loads[m] - delta, loads[r] + delta)
        fits = (used[m] - dtok <= cap) & (used[r] + dtok <= cap) & (delta > 0)
        peak = np.where(fits, peak, np.inf)
        k = int(np.argmin(peak))
        if peak.flat[k] < best_peak:
            i, j = divmod(k, len(theirs))
            best_peak, best = peak.flat[k], (mine[i], r, theirs[j])
    return best


def balance_assignment(
    costs: np.ndarray,
    tokens: np.ndarray,
    num_ranks: int,
    *,
    max_tokens: int | None = None,
    max_rounds: int | None = None,
) -> np.ndarray:
    """The rank of every sample: LPT, then move/swap refinement of the most loaded rank.

    ``max_tokens`` caps the tokens a rank may hold (None: no cap). Raises :class:`CapInfeasible`
    when LPT cannot place a sample under the cap. ``max_rounds`` bounds the refinement
    (default ``4 * len(costs)``); every round strictly lowers the most loaded rank's cost.
    """
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.float64)
    if costs.shape != tokens.shape or costs.ndim != 1:
        raise ValueError(f"costs and tokens must be 1-D of equal length, got {costs.shape} and {tokens.shape}")
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    cap = float("inf") if max_tokens is None else float(max_tokens)
    assignment = _lpt(costs, tokens, num_ranks, cap)
    loads = rank_loads(costs, assignment, num_ranks)
    used = np.bincount(assignment, weights=tokens, minlength=num_ranks)
    for _ in range(4 * len(costs) if max_rounds is None else max_rounds):
        m = int(np.argmax(loads))
        step = _best_step(costs, tokens, assignment, loads, used, cap, m)
        if step is None:
            break
        i, r, j = step
        for sample, src, dst in ((i, m, r), *(((j, r, m),) if j is not None else ())):
            assignment[sample] = dst
            loads[src] -= costs[sample]
            loads[dst] += costs[sample]
            used[src] -= tokens[sample]
            used[dst] += tokens[sample]
    return assignment


def keep_local(assignment: np.ndarray, origin: np.ndarray, tokens: np.ndarray, num_ranks: int) -> np.ndarray:
    """Relabel the ranks of ``assignment`` (ranks are interchangeable) so that as many tokens as
    possible stay on the rank that already holds them: greedy on the largest overlaps. The loads
    are unchanged; the all-to-all moves less."""
    overlap = np.zeros((num_ranks, num_ranks))
    np.add.at(overlap, (assignment, origin), np.asarray(tokens, dtype=np.float64))
    relabel = np.full(num_ranks, -1, dtype=np.int64)
    taken = np.zeros(num_ranks, dtype=bool)
    # Stable order over (overlap desc, bin, rank) keeps this deterministic.
    for flat in np.lexsort((np.arange(num_ranks * num_ranks), -overlap.ravel())):
        b, r = divmod(int(flat), num_ranks)
        if relabel[b] < 0 and not taken[r]:
            relabel[b], taken[r] = r, True
    return relabel[assignment]
