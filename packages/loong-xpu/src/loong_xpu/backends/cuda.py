"""NVIDIA GPUs: the native target of megatron-core, so nothing is redirected."""

from __future__ import annotations

import torch

from loong_xpu.accelerator import FEATURES, Accelerator, MemoryStats

# Dense (no sparsity) peak FLOP/s per GPU, from the vendors' data sheets.
_PEAK_FLOPS = {
    # substring of torch.cuda.get_device_name(): {dtype: FLOP/s}
    "H200": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "H100": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "H800": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
    "A800": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
    "L40S": {torch.bfloat16: 362e12, torch.float16: 362e12, torch.float32: 91.6e12},
}

# FP8 recipes by the first compute capability that runs them: FP8 tensor cores from Ada (sm_89);
# TE's block-scaled FP8 from Hopper (sm_90); MXFP8's E8M0 block scales from Blackwell (sm_100).
_FP8_RECIPES = ((("delayed", "tensorwise"), (8, 9)), (("blockwise",), (9, 0)), (("mxfp8",), (10, 0)))


def fp8_recipes_for(capability: tuple[int, int]) -> frozenset[str]:
    """The FP8 recipes a GPU of this compute capability runs (H100 / H200: (9, 0))."""
    return frozenset(r for recipes, first in _FP8_RECIPES if tuple(capability) >= first for r in recipes)


class CudaAccelerator(Accelerator):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    priority = 100
    # every optional feature exists on CUDA (whether its package, e.g. TE, is installed is checked where it is used)
    features = frozenset(FEATURES)
    needs_cuda_redirect = False

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def current_device_index(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def get_rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def fp8_recipes(self) -> frozenset[str]:
        return fp8_recipes_for(torch.cuda.get_device_capability())

    def device_name(self) -> str:
        return torch.cuda.get_device_name()

    def memory_stats(self) -> MemoryStats:
        return MemoryStats(
            allocated=torch.cuda.memory_allocated(),
            peak_allocated=torch.cuda.max_memory_allocated(),
            reserved=torch.cuda.memory_reserved(),
        )

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak_flops(self, dtype: torch.dtype = torch.bfloat16) -> float | None:
        override = super().peak_flops(dtype)
        if override is not None:
            return override
        name = torch.cuda.get_device_name()
        for key, table in _PEAK_FLOPS.items():
            if key in name:
                return table.get(dtype)
        return None

    @property
    def preferred_dtype(self) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
