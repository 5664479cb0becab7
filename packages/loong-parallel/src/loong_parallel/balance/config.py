"""``parallel.balance``: data-parallel load balancing of packed samples."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BalanceConfig:
    enabled: bool = False  # rebalance each global batch across DP ranks (needs data.packing=thd)
    min_imbalance: float = 0.05  # skip when the predicted max/mean - 1 is already at most this
    max_tokens_per_rank: int | None = None  # per-rank token cap of the assignment; None = no cap
    refit: bool = True  # refit the FLOP-based cost from measured compute times
    refit_warmup_steps: int = 3
    refit_interval: int = 10
    refit_window: int = 50  # steps of measurements the fit uses

    def errors(self) -> list[str]:
        """Problems with these keys, each naming the key (empty when fine)."""
        errors = []
        if self.min_imbalance < 0:
            errors.append(f"parallel.balance.min_imbalance={self.min_imbalance} must be >= 0")
        if self.refit_warmup_steps < 0 or self.refit_interval < 1 or self.refit_window < 1:
            errors.append("parallel.balance needs refit_warmup_steps >= 0, refit_interval >= 1, refit_window >= 1")
        return errors
