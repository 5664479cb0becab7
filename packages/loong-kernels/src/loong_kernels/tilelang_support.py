"""Whether TileLang can be used here, imported lazily so that CPU-only installs never touch it."""

from __future__ import annotations

import functools
import shutil

from loong_kernels._log import logger

# The architecture the kernels are written for (Hopper); the CPU compile tests target it too.
SM90_TARGET = {"kind": "cuda", "arch": "sm_90a"}


@functools.cache
def tilelang_importable() -> bool:
    try:
        import tilelang  # noqa: F401
    except Exception as e:  # an import of a CUDA toolchain wrapper can fail in many ways
        logger.info("tilelang is not usable (%s); the torch references will be used", e)
        return False
    return True


def nvcc_available() -> bool:
    return shutil.which("nvcc") is not None

