"""LeRobot datasets (format v3.0 and v2.1): reading with action chunks, writing, statistics and
normalisation, and Pi0.5's prompt (task + discretised state)."""

from loong_data.lerobot.batches import Pi05BatchConfig, Pi05Batcher, rank_batches
from loong_data.lerobot.dataset import LeRobotDataset
from loong_data.lerobot.meta import DatasetMeta, read_meta
from loong_data.lerobot.prompt import discretise_state, state_prompt
from loong_data.lerobot.stats import Normalizer, aggregate_stats, feature_stats
from loong_data.lerobot.writer import LeRobotWriter

__all__ = ["DatasetMeta", "LeRobotDataset", "LeRobotWriter", "Normalizer", "Pi05BatchConfig", "Pi05Batcher", "rank_batches", "aggregate_stats", "discretise_state",
           "feature_stats", "read_meta", "state_prompt"]  # fmt: skip
