"""loong-xpu: one Accelerator API for CUDA, CPU and out-of-tree devices.

    from loong_xpu import get_accelerator, redirect_cuda
    accel = get_accelerator()          # LOONG_DEVICE=auto|cuda|cpu|<plugin>
    with redirect_cuda(accel):         # applies the patch manifest (loong_xpu.patches.MANIFEST)
        ...

Off CUDA the manifest redirects megatron-core's CUDA calls to the accelerator; on CUDA it applies
only the entries marked ``on_cuda`` (apex stand-ins and megatron corrections, each with its reason).
"""

from loong_xpu.accelerator import FEATURES, Accelerator, MemoryStats, UnsupportedFeatureError
from loong_xpu.patches import MANIFEST, Patch, PatchSet, apply_patches, redirect_cuda
from loong_xpu.registry import ENTRY_POINT_GROUP, backend_names, get_accelerator

__version__ = "0.1.0"
__all__ = [
    "ENTRY_POINT_GROUP",
    "FEATURES",
    "MANIFEST",
    "Accelerator",
    "MemoryStats",
    "Patch",
    "PatchSet",
    "UnsupportedFeatureError",
    "apply_patches",
    "backend_names",
    "get_accelerator",
    "redirect_cuda",
]
