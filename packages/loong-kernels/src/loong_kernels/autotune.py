"""A measured choice between implementations of one op, made once per key and cached.

At the first call for a key (op, shape bucket, dtype, device), every candidate that can run
is run on the call's real inputs: the reference first (its outputs are the truth), then each
other candidate, which is skipped (with a log line) when it raises or disagrees with the
reference beyond the op's tolerance. The survivors are timed (median of ``iters`` runs after
that first, warm-up, run: it also compiles JIT kernels) and the fastest wins. The decision table
is logged once, when it is made.

Lifetime: the cache is this object's. :mod:`loong_kernels.dispatch` owns one :class:`Autotuner`
in its process-wide dispatcher, so a decision lasts for the process; a fresh ``Autotuner``
(e.g. a :class:`~loong_kernels.dispatch.Dispatcher` in ``use_dispatcher``) starts empty.

Across ranks: when ``torch.distributed`` is initialised with more than one rank, the first rank
of the decision group broadcasts its decision (``broadcast_object_list``), so every rank of the
group runs the same implementation even where its own timings would differ. The group is the
ranks that run the same layers in lockstep: with megatron-core's parallel state initialised,
the TP x DP x CP group of this pipeline stage (stages reach their first call at different
times, so a world-wide collective could deadlock against the pipeline's sends); otherwise the
world. This is a collective: every rank of the group must reach a new key at the same call,
which holds in SPMD training where they run the op on the same shape bucket in the same order.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, replace

import torch

from loong_kernels._log import logger

Step = Callable[[], list[torch.Tensor]]
Check = Callable[[list[torch.Tensor], list[torch.Tensor]], float]


@dataclass(frozen=True)
class Decision:
    key: Hashable
    winner: str
    ms: dict[str, float]  # median milliseconds of every timed candidate
    skipped: dict[str, str]  # candidate -> why it was not timed
    decided_by: str = "this process"


def token_bucket(n: int) -> str:
    """A token count rounded up to a power of two: one decision serves the lengths of a bucket."""
    return f"T<={1 << max(n - 1, 0).bit_length()}"


class Autotuner:
    """Picks the fastest candidate that agrees with the reference, per key; see the module doc."""

    def __init__(self, iters: int = 3) -> None:
        if iters < 1:
            raise ValueError(f"Autotuner iters must be >= 1, got {iters}")
        self.iters = iters
        self.cache: dict[Hashable, Decision] = {}

    def pick(
        self,
        key: Hashable,
        candidates: Mapping[str, Step],
        *,
        reference: str,
        check: Check,
        tol: float,
        skipped: Mapping[str, str] | None = None,
        fallback: str | None = None,
    ) -> str:
        """The winner for ``key``: cached, or measured now over ``candidates`` (name -> a step that
        runs that implementation on the real inputs and returns the outputs to compare).
        ``skipped``: candidates that cannot run these inputs, with the reason (logged in the table).
        ``fallback``: the choice when the reference itself fails (e.g. out of memory), so that no
        candidate can be checked; None re-raises the reference's error."""
        if key not in self.cache:
            if reference not in candidates:
                raise ValueError(f"autotune {key}: the reference {reference!r} is not among {list(candidates)}")
            try:
                decision = self._measure(key, candidates, reference, check, tol, dict(skipped or {}))
            except _ReferenceFailed as e:
                if fallback is None:
                    raise e.__cause__ from None
                logger.warning("autotune %s: the reference failed (%s); nothing can be checked, using %s", key, e, fallback)
                decision = Decision(key, fallback, {}, {**(skipped or {}), reference: str(e)}, "the fallback")
            decision = _agree_across_ranks(decision)
            self.cache[key] = decision
            logger.info(format_decision(decision))
        return self.cache[key].winner

    def _measure(
        self, key: Hashable, candidates: Mapping[str, Step], reference: str, check: Check, tol: float,
        skipped: dict[str, str],
    ) -> Decision:  # fmt: skip
        try:
            truth = candidates[reference]()
        except Exception as e:  # no truth, no measured decision
            raise _ReferenceFailed(_why(e)) from e
        ms = {reference: self._time(candidates[reference], truth)}
        for name, step in candidates.items():
            if name == reference:
                continue
            try:
                diff = check(step(), truth)
                if not diff <= tol:  # NaN disagrees too
                    raise ValueError(f"differs from {reference}: {diff:.3g} > {tol}")
                ms[name] = self._time(step, truth)
            except Exception as e:  # any failure of a candidate only removes it from the race
                skipped[name] = _why(e)
                logger.warning("autotune %s: skipping %s (%s)", key, name, skipped[name])
        winner = min(ms, key=ms.__getitem__)
        return Decision(key, winner, ms, skipped)

    def _time(self, step: Step, like: list[torch.Tensor]) -> float:
        cuda = any(t.is_cuda for t in like)
        times = []
        for _ in range(self.iters):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)


class _ReferenceFailed(Exception):
    """The reference implementation itself failed, so no candidate can be checked against it."""


def _why(e: Exception) -> str:
    """An exception as one short line for the log and the table."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def _decision_group() -> object | None:
    """This pipeline stage's TP x DP x CP group when megatron-core's parallel state is up (looked up
    only if megatron-core is already imported), else None: the world."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        return ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return None


def _agree_across_ranks(decision: Decision) -> Decision:
    """The decision of the group's first rank on every rank of the group (unchanged when not distributed)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return decision
    group = _decision_group()
    size = dist.get_world_size(group)
    if size == 1:
        return decision
    box = [decision if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, group=group, group_src=0)
    chosen: Decision = box[0]  # type: ignore[assignment]
    return replace(chosen, decided_by=f"rank 0 of {size}")


def format_decision(d: Decision) -> str:
    """The decision table: one line per candidate, timed ones fastest first."""
    lines = [f"autotune {d.key}: {d.winner} (decided by {d.decided_by})", f"  {'impl':<12}{'ms':>10}"]
    for name, ms in sorted(d.ms.items(), key=lambda kv: kv[1]):
        lines.append(f"  {name:<12}{ms:10.3f}" + ("  <- chosen" if name == d.winner else ""))
    lines += [f"  {name:<12}{'skipped':>10}  {why}" for name, why in d.skipped.items()]
    return "\n".join(lines)
