"""The ``model.lora`` config node: low-rank adapters on chosen linears of chosen components."""

from __future__ import annotations

from dataclasses import dataclass, field

# The linears of a megatron transformer layer (attention: fused Q/K/V in, output out; MLP: fc1
# (gate+up for SwiGLU), fc2). Patterns match a module's own name or its dotted path (fnmatch).
DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input, training only
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    components: list[str] = field(default_factory=lambda: ["foundation"])
    # A PEFT LoRA adapter directory the adapters start from (loong_ckpt.peft_import); None = B = 0.
    init_from: str | None = None

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def validate(self, prefix: str = "model.lora") -> None:
        """Raise ValueError naming the offending key."""
        if self.rank < 1:
            raise ValueError(f"{prefix}.rank={self.rank} must be >= 1")
        if self.alpha <= 0:
            raise ValueError(f"{prefix}.alpha={self.alpha} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{prefix}.dropout={self.dropout} must be in [0, 1)")
        if not self.targets:
            raise ValueError(f"{prefix}.targets is empty; e.g. [{', '.join(DEFAULT_TARGETS)}]")
        if not self.components:
            raise ValueError(f"{prefix}.components is empty; e.g. [foundation]")
