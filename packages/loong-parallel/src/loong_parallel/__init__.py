"""loong-parallel: the parallel runtime between the model zoo and the train app.

Process groups (TP / PP / DP / EP), megatron-core DDP and optimizer wiring, pipeline schedules, and
data-parallel load balancing (:mod:`loong_parallel.balance`), MoE router statistics.
"""

from loong_parallel.balance import DPBalancer, OnlineCostFit, QuadraticCost
from loong_parallel.config import ParallelConfig
from loong_parallel.distributed import DistEnv, init_distributed, initialize_model_parallel, shutdown
from loong_parallel.model import ModelProvider, build_model_chunks, unwrap
from loong_parallel.moe import RouterStats
from loong_parallel.nonfinite import NonFiniteError, NonFiniteGuard
from loong_parallel.optimizer import OptimConfig, build_optimizer, follow_config_schedule
from loong_parallel.runtime import runtime_transformer_fields
from loong_parallel.step import LOSS_KEY, StepResult, eval_step, train_step

__version__ = "0.1.0"
__all__ = [
    "LOSS_KEY",
    "DPBalancer",
    "DistEnv",
    "ModelProvider",
    "NonFiniteError",
    "NonFiniteGuard",
    "OnlineCostFit",
    "OptimConfig",
    "ParallelConfig",
    "QuadraticCost",
    "RouterStats",
    "StepResult",
    "build_model_chunks",
    "build_optimizer",
    "eval_step",
    "follow_config_schedule",
    "init_distributed",
    "initialize_model_parallel",
    "runtime_transformer_fields",
    "shutdown",
    "train_step",
    "unwrap",
]
