"""Data-parallel load balancing: cost model, assignment, all-to-all exchange, online refit, and the
training run's balancer (``parallel.balance``, :func:`build_balancer`)."""

from loong_parallel.balance.assign import CapInfeasible, balance_assignment, imbalance, keep_local, rank_loads
from loong_parallel.balance.balancer import BalancePlan, DPBalancer, plan_balance
from loong_parallel.balance.config import BalanceConfig
from loong_parallel.balance.cost import (
    QuadraticCost,
    SampleCost,
    fit_quadratic_cost,
    nonnegative_fit,
    segment_features,
)
from loong_parallel.balance.exchange import FieldSpec, exchange_samples, field_specs
from loong_parallel.balance.multimodal import MultimodalCost, split_media, vision_sizes
from loong_parallel.balance.refit import OnlineCostFit
from loong_parallel.balance.train import TrainBalancer, build_balancer, segment_lengths

__all__ = [
    "BalanceConfig",
    "BalancePlan",
    "CapInfeasible",
    "DPBalancer",
    "FieldSpec",
    "MultimodalCost",
    "OnlineCostFit",
    "QuadraticCost",
    "SampleCost",
    "TrainBalancer",
    "balance_assignment",
    "split_media",
    "build_balancer",
    "exchange_samples",
    "field_specs",
    "fit_quadratic_cost",
    "imbalance",
    "keep_local",
    "nonnegative_fit",
    "plan_balance",
    "rank_loads",
    "segment_features",
    "segment_lengths",
    "vision_sizes",
]
