"""loong-parallel: the parallel runtime between the model zoo and the train app.

Process groups (TP / PP / DP / EP), megatron-core DDP and optimizer wiring, pipeline schedules, and
data-parallel load balancing (:mod:`loong_parallel.balance`), MoE router statistics.
"""

from loong_parallel.balance import (
    BalanceConfig,
    DPBalancer,
    OnlineCostFit,
    QuadraticCost,
    TrainBalancer,
    build_balancer,
)
from loong_parallel.capabilities import require_features
from loong_parallel.chunkpipe_schedule import chunkpipe_schedule
from loong_parallel.config import ChunkPipeConfig, ParallelConfig
from loong_parallel.diffusion import DiffusionModel
from loong_parallel.distributed import (
    DataParallel,
    DistEnv,
    data_parallel,
    init_distributed,
    initialize_model_parallel,
    shutdown,
)
from loong_parallel.embodied import EmbodiedPolicy, model_kind
from loong_parallel.forward import lm_forward_step, masked_token_loss
from loong_parallel.kinds import LanguageModel, ModelKind
from loong_parallel.model import ModelProvider, build_model_chunks, unwrap
from loong_parallel.moe import RouterStats
from loong_parallel.nonfinite import NonFiniteError, NonFiniteGuard
from loong_parallel.optimizer import OptimConfig, build_optimizer
from loong_parallel.profiler import ProfileConfig, StepProfiler
from loong_parallel.rng import rng_state, seed_everything, set_rng_state
from loong_parallel.runtime import runtime_transformer_fields
from loong_parallel.schedule import microbatch_iterators, schedule_shape
from loong_parallel.step import LOSS_KEY, StepResult, eval_step, train_step
from loong_parallel.step_window import StepClock, StepWindow

__version__ = "0.1.0"
__all__ = [
    "ChunkPipeConfig",
    "chunkpipe_schedule",
    "model_kind",
    "LOSS_KEY",
    "BalanceConfig",
    "DPBalancer",
    "DataParallel",
    "DistEnv",
    "DiffusionModel",
    "EmbodiedPolicy",
    "LanguageModel",
    "model_kind",
    "ModelKind",
    "ModelProvider",
    "NonFiniteError",
    "NonFiniteGuard",
    "OnlineCostFit",
    "OptimConfig",
    "ParallelConfig",
    "QuadraticCost",
    "RouterStats",
    "StepResult",
    "StepClock",
    "StepWindow",
    "StepProfiler",
    "ProfileConfig",
    "TrainBalancer",
    "build_balancer",
    "build_model_chunks",
    "build_optimizer",
    "data_parallel",
    "eval_step",
    "init_distributed",
    "initialize_model_parallel",
    "lm_forward_step",
    "masked_token_loss",
    "microbatch_iterators",
    "require_features",
    "rng_state",
    "runtime_transformer_fields",
    "schedule_shape",
    "seed_everything",
    "set_rng_state",
    "shutdown",
    "train_step",
    "unwrap",
]
