import itertools

import pytest
import torch

from loong_models.embodied import Pi05Config
from loong_models.embodied.pi05.config import GemmaConfig, SiglipConfig
from loong_xpu.testing import megatron_cpu, megatron_cuda  # noqa: F401  (fixtures: a one-process megatron world on the CPU / GPU)

TINY_PI05 = Pi05Config(
    vision=SiglipConfig(image_size=32, patch_size=16, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_attention_heads=2),
    vlm=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=2, num_kv_heads=1, head_dim=8),
    expert=GemmaConfig(width=16, depth=2, mlp_dim=32, num_heads=2, num_kv_heads=1, head_dim=8),
    vocab_size=64, chunk_size=4, max_action_dim=6, max_state_dim=6, tokenizer_max_length=8,
)  # fmt: skip


def _pi05_batches(seed: int, micro_batch: int = 2):
    """Random Pi0.5 micro-batches for TINY_PI05 (4 of 6 action dims real, 6 of 8 prompt tokens)."""
    g = torch.Generator().manual_seed(seed)
    for start in itertools.count(0, micro_batch):
        yield {
            "images": torch.rand(micro_batch, 1, 3, 32, 32, generator=g) * 2 - 1,
            "image_masks": torch.ones(micro_batch, 1, dtype=torch.bool),
            "tokens": torch.randint(0, 64, (micro_batch, 8), generator=g),
            "token_mask": torch.arange(8).expand(micro_batch, 8) < 6,
            "actions": torch.randn(micro_batch, 4, 6, generator=g),
            "action_dim_mask": torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.bool),
            "sample_ids": torch.arange(start, start + micro_batch),
        }


@pytest.fixture
def tiny_pi05() -> Pi05Config:
    return TINY_PI05


@pytest.fixture
def pi05_batches():
    return _pi05_batches
