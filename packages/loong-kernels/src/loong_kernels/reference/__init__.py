"""Plain-torch references of every op: the definitions the TileLang kernels are tested against.

They run on any device and are what :mod:`loong_kernels.dispatch` picks where TileLang cannot run.
"""

from loong_kernels.reference import dsa
from loong_kernels.reference.linear_cross_entropy import (
    linear_cross_entropy_chunked,
    linear_cross_entropy_tokens_chunked,
    linear_cross_entropy_unfused,
)
from loong_kernels.reference.linear_cross_entropy_fp8 import linear_cross_entropy_tokens_fp8_chunked
from loong_kernels.reference.rms_norm import rms_norm_bwd, rms_norm_fwd
from loong_kernels.reference.swiglu import swiglu_bwd, swiglu_fwd

__all__ = [
    "dsa",
    "linear_cross_entropy_chunked",
    "linear_cross_entropy_tokens_chunked",
    "linear_cross_entropy_tokens_fp8_chunked",
    "linear_cross_entropy_unfused",
    "rms_norm_bwd",
    "rms_norm_fwd",
    "swiglu_bwd",
    "swiglu_fwd",
]
