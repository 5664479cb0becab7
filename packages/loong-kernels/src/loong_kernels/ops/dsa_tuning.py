"""What the autotuner runs for DSA's sparse MLA and indexer top-k (:data:`loong_kernels.dispatch.TUNED`):
the shape bucket a decision is kept for, and one run (sparse MLA: forward + backward) on the call's real inputs."""

from __future__ import annotations

from collections.abc import Callable

import torch

from loong_kernels.autotune import Step, token_bucket


def sparse_mla_bucket(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, scale: float) -> tuple:
    """Tokens rounded up to a power of two; heads, top-k and widths exactly (kernels specialise on them).
    Queries that are a part of the keys (a context-parallel rank's) are a bucket of their own: only
    the reference takes them, and a square shape's winner must not be reused for them."""
    key = (token_bucket(q.shape[0]), f"H={q.shape[1]}", f"K={indices.shape[1]}", f"d_qk={q.shape[2]}", f"d_v={d_v}")
    return key if kv.shape[0] == q.shape[0] else (*key, f"keys={token_bucket(kv.shape[0])}")


def sparse_mla_trial(
    kernels: dict[str, Callable], q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, scale: float
) -> Step:
    """Forward then backward (a fixed random output gradient): ``[out, lse, dq, dkv]``, the LSE
    with empty rows' ``-inf`` as 0 so that the check compares finite numbers."""
    g = torch.Generator(device=q.device).manual_seed(0)
    dout = torch.randn(q.shape[0], q.shape[1], d_v, device=q.device, dtype=q.dtype, generator=g)
    fwd, bwd = kernels["sparse_mla_fwd"], kernels["sparse_mla_bwd"]

    def step() -> list[torch.Tensor]:
        out, lse = fwd(q, kv, indices, d_v, scale)
        dq, dkv = bwd(q, kv, out, dout, indices, lse, d_v, scale)
        return [out, lse.masked_fill(torch.isinf(lse), 0.0), dq, dkv]

    return step


def indexer_topk_bucket(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, topk: int) -> tuple:
    return (token_bucket(q_i.shape[0]), f"H_i={q_i.shape[1]}", f"D_i={q_i.shape[2]}", f"K={topk}")


def indexer_topk_trial(
    kernels: dict[str, Callable], q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, topk: int
) -> Step:
    """The selected keys ``[idx]`` (compared as the fraction the reference did not select)."""
    return lambda: [kernels["indexer_topk"](q_i, k_i, w, starts, topk)]
