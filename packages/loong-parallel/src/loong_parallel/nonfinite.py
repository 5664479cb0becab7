"""Stop a run that keeps producing NaN / Inf instead of training on it."""

from __future__ import annotations

from loong_parallel.log import logger
from loong_parallel.step import StepResult


class NonFiniteError(RuntimeError):
    """Too many steps in a row had a NaN / Inf loss or gradient."""


class NonFiniteGuard:
    """Counts consecutive steps that :func:`~loong_parallel.train_step` skipped for a non-finite
    loss or gradient; each is logged, and ``limit`` in a row raise :class:`NonFiniteError`."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"non-finite step limit {limit} must be >= 1")
        self.limit = limit
        self.in_a_row = 0

    def observe(self, step: int, result: StepResult) -> None:
        if not result.nonfinite:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        logger.warning(
            "step %d: loss %s, grad norm %s: not finite, update skipped (%d in a row, limit %d)",
            step, result.loss, result.grad_norm, self.in_a_row, self.limit,
        )  # fmt: skip
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"{self.in_a_row} steps in a row (up to step {step}) had a NaN / Inf loss or gradient "
                f"(last loss {result.loss}); stopping. Lower optim.lr, check the data and the initial weights, "
                "or resume from an earlier checkpoint"
            )
