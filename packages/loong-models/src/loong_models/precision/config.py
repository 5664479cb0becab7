"""A component's numeric precision: ``model.<component>.precision`` (FP8 off / on / adaptive)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FP8Mode(StrEnum):
    """Whether the component's TE GEMMs run in FP8."""

    off = "off"  # bf16 / the run's dtype everywhere
    on = "on"  # every TE linear in FP8 (megatron's global fp8 recipe)
    adaptive = "adaptive"  # per GEMM kind, where the measured policy file says FP8 wins at this run's shapes


class FP8Recipe(StrEnum):
    """How FP8 tensors are scaled (megatron's fp8_recipe; TE recipe in brackets)."""

    tensorwise = "tensorwise"  # one scale per tensor from its current amax (Float8CurrentScaling)
    blockwise = "blockwise"  # 1x128 / 128x128 block scales, DeepSeek-V3's recipe (Float8BlockScaling; sm_90+)
    delayed = "delayed"  # per-tensor scales from an amax history (DelayedScaling); global only
    mxfp8 = "mxfp8"  # 1x32 E8M0 block scales (MXFP8BlockScaling; Blackwell, sm_100+)


@dataclass
class PrecisionConfig:
    fp8: FP8Mode = FP8Mode.off
    recipe: FP8Recipe = FP8Recipe.tensorwise
    # fp8=adaptive: the policy file written by bench/fp8_policy.py (JSON or YAML) on this GPU
    policy: str | None = None
    # Tokens one GEMM sees per micro-batch, the policy's lookup key; null = the run's
    # data.seq_length x train.micro_batch_size / parallel.cp
    num_tokens: int | None = None
    # The output layer's three GEMMs (logits, and both gradients) in FP8 as well: loong_kernels'
    # FP8 fused loss, tensorwise whatever the recipe (E4M3 hidden states and weight, E5M2
    # gradient). Megatron keeps the LM head in BF16 on Hopper (its FP8 head is MXFP8-only); at
    # an 8B shape cut to 4 layers it is ~38% of the GEMM FLOPs. Needs the foundation's
    # output_loss=fused.
    fp8_output_layer: bool = False

    @property
    def enabled(self) -> bool:
        return self.fp8 != FP8Mode.off

    def validate(self, prefix: str) -> None:
        """Raise ValueError naming the key for settings that contradict each other."""
        if self.fp8 not in tuple(FP8Mode):  # OmegaConf checks the enums; direct construction does not
            raise ValueError(f"{prefix}.fp8={str(self.fp8)!r}; allowed: {', '.join(FP8Mode)}")
        if self.recipe not in tuple(FP8Recipe):
            raise ValueError(f"{prefix}.recipe={str(self.recipe)!r}; allowed: {', '.join(FP8Recipe)}")
        if self.fp8 == FP8Mode.adaptive:
            if not self.policy:
                raise ValueError(f"{prefix}.fp8=adaptive needs {prefix}.policy (a file written by bench/fp8_policy.py)")
            if self.recipe == FP8Recipe.delayed:
                raise ValueError(f"{prefix}.recipe=delayed cannot be adaptive: megatron's per-module quantisation "
                                 "rejects delayed scaling; use tensorwise or blockwise, or fp8=on")  # fmt: skip
        elif self.policy is not None:
            raise ValueError(f"{prefix}.policy is only read with {prefix}.fp8=adaptive (got fp8={self.fp8})")
        if self.fp8_output_layer and self.fp8 == FP8Mode.off:
            raise ValueError(f"{prefix}.fp8_output_layer=true needs {prefix}.fp8=on or adaptive (the layers in FP8 first)")
        if self.num_tokens is not None and self.num_tokens < 1:
            raise ValueError(f"{prefix}.num_tokens={self.num_tokens} must be >= 1 or null (auto)")
