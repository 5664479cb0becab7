"""Config of the packed (THD) data path and of DP load balancing: ``data.packing``,
``data.thd.*``, ``data.balance.*``. Kept apart from schema.py so that the default fixed-length
path stays untouched."""

from __future__ import annotations

from dataclasses import dataclass

from loong_data import STRATEGIES

PACKING = ("fixed", "thd")


@dataclass
class ThdConfig:
    strategy: str = "ffd"  # ffd (first-fit decreasing) | sequential
    buffer_size: int | None = None  # samples ffd reorders together; None = a rank's whole step
    # Documents are cut into samples of lognormal lengths (median, sigma), at most data.seq_length
    # tokens; long_fraction of the cuts are data.seq_length long (a long tail like mixed data).
    median_length: int = 96
    sigma: float = 1.0
    long_fraction: float = 0.0


@dataclass
class BalanceConfig:
    enabled: bool = False  # rebalance each global batch across DP ranks (needs data.packing=thd)
    min_imbalance: float = 0.05  # skip when the predicted max/mean - 1 is already at most this
    max_tokens_per_rank: int | None = None  # per-rank token cap of the assignment; None = no cap
    refit: bool = True  # refit the FLOP-based cost from measured compute times
    refit_warmup_steps: int = 3
    refit_interval: int = 10
    refit_window: int = 50  # steps of measurements the fit uses


def validate_packing(packing: str, thd: ThdConfig, balance: BalanceConfig, *, seq_length: int, tp: int,
                     sequence_parallel: bool) -> list[str]:
    """Problems with the packing keys, each naming the key (empty when fine)."""
    errors = []
    if packing not in PACKING:
        errors.append(f"data.packing={packing!r}; allowed: {', '.join(PACKING)}")
    if thd.strategy not in STRATEGIES:
        errors.append(f"data.thd.strategy={thd.strategy!r}; allowed: {', '.join(STRATEGIES)}")
    if thd.buffer_size is not None and thd.buffer_size < 1:
        errors.append(f"data.thd.buffer_size={thd.buffer_size} must be >= 1 or null")
    if thd.median_length < 1 or thd.sigma < 0 or not 0 <= thd.long_fraction <= 1:
        errors.append("data.thd needs median_length >= 1, sigma >= 0 and long_fraction in [0, 1]")
    if packing == "thd" and sequence_parallel and seq_length % tp:
        errors.append(f"data.seq_length={seq_length} must be a multiple of parallel.tp={tp} for packed "
                      "sequences with sequence parallelism")
    if balance.enabled and packing != "thd":
        errors.append("data.balance.enabled=true needs data.packing=thd")
    if balance.min_imbalance < 0:
        errors.append(f"data.balance.min_imbalance={balance.min_imbalance} must be >= 0")
    if balance.max_tokens_per_rank is not None and balance.max_tokens_per_rank < seq_length:
        errors.append(f"data.balance.max_tokens_per_rank={balance.max_tokens_per_rank} must be null or "
                      f">= data.seq_length ({seq_length})")
    if balance.refit_warmup_steps < 0 or balance.refit_interval < 1 or balance.refit_window < 1:
        errors.append("data.balance needs refit_warmup_steps >= 0, refit_interval >= 1, refit_window >= 1")
    return errors
