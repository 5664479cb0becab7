"""Pi0.5: a PaliGemma VLM with a flow-matching Gemma action expert (see model.py)."""

from loong_models.embodied.pi05.config import GemmaConfig, Pi05Config, SiglipConfig
from loong_models.embodied.pi05.flow import euler_sample, noisy_actions, sample_time, time_embedding
from loong_models.embodied.pi05.model import Pi05Policy, attention_mask

__all__ = ["GemmaConfig", "Pi05Config", "Pi05Policy", "SiglipConfig", "attention_mask",            "euler_sample", "noisy_actions", "sample_time",  "time_embedding"]  # fmt: skip
