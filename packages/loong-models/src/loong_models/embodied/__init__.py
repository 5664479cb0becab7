"""Embodied models (vision-language-action policies): plain ``nn.Module`` s that the train app
wraps in megatron-core's DDP and distributed optimizer (data-parallel only: they are < 10B)."""

from loong_models.embodied.pi05 import Pi05Config, Pi05Policy

__all__ = ["Pi05Config", "Pi05Policy"]
