"""The precision references compute in: float32, or float64 when given float64 (for gradcheck)."""

import torch


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def acc(x: torch.Tensor) -> torch.Tensor:
    return x.to(acc_dtype(x))
