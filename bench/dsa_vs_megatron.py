"""Loong's fused DSA kernels against megatron-core's own and against the torch reference, on the
same inputs, with the outputs checked against the float32 reference.

megatron-core 0.19 ships TileLang DSA kernels (``megatron.core.transformer.experimental_attention_variant.ops``):
``SparseMLA`` (sparse MLA forward + backward; its backward recomputes the forward) and
``run_fused_qk_topk`` (its DSA layer's fused indexer hook: lightning-indexer scores + top-k). The cases:

- ``sparse MLA fwd+bwd``: q [T, H, 576], one latent KV head [T, 576], top-k indices [T, K]:
  output and dq, dkv. Loong (loong_kernels.tl.sparse_mla) vs megatron-core vs the reference in
  float32 and with TF32 matmuls. Checked: max |diff| / max |reference| of every tensor <= --rtol.
- ``indexer top-k``: indexer q [T, 64, 128], k [T, 128], weights [T, 64] over two packed
  documents: the selected keys. Loong (TileLang scores + torch.topk) vs megatron-core vs the
  reference. Checked: the fraction of selected keys that the float32 reference did not select
  <= --max-miss (bf16 scores round near-ties differently).

    python bench/dsa_vs_megatron.py                                   # T=8192, H=128, top-k 2048
    python bench/dsa_vs_megatron.py --shapes 8192x128x2048 4096x128x2048 8192x64x2048 8192x16x2048

Prints one table per run (ms = median of --iters, CUDA events), each shape's Loong / megatron-core
speed ratio (the issue's target: >= 1.0x at T=8K, H=128, top-k 2048), the decision tables of
``loong_kernels.dispatch`` for each shape's sparse MLA and indexer top-k (what training would run),
and exits 1 when an implementation raised or failed its check. Needs CUDA and tilelang.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernels import Case, Row, _dsa_inputs, _measure  # noqa: E402

from loong_kernels import autotune, dispatch  # noqa: E402
from loong_kernels.agreement import missed_fraction, rel_diff  # noqa: E402
from loong_kernels.reference import dsa as ref_dsa  # noqa: E402

IDX_HEADS = 64
D_V = 512
IMPLS = ("loong", "megatron", "reference", "reference-tf32")


def parse_shape(text: str) -> tuple[int, int, int]:
    """``TxHxK`` -> (T, H, K)."""
    try:
        seq, heads, topk = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes {text!r}: expected TxHxK, e.g. 8192x128x2048") from None
    if min(seq, heads, topk) < 1:
        raise SystemExit(f"--shapes {text!r}: sizes must be >= 1")
    return seq, heads, topk


def tf32(step: Callable[[], list[torch.Tensor]]) -> Callable[[], list[torch.Tensor]]:
    """The step with float32 matmuls on TF32 tensor cores (the fast float32 baseline)."""

    def run() -> list[torch.Tensor]:
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return step()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before

    return run


def _stacks(ours: Callable[[str], Callable], megatron: Callable[[], Callable] | None) -> dict[str, Callable]:
    """A case's stacks: Loong's kernel, the torch reference in fp32 and TF32, and (on CUDA, when
    ``megatron`` builds its step) megatron-core's kernel."""
    steps = {"loong": ours("loong"), "reference": ours("reference"), "reference-tf32": tf32(ours("reference"))}
    if megatron is not None:
        steps["megatron"] = _or_raise(megatron)
    return steps


def _kernel(name: str, impl: str) -> Callable:
    entry = dispatch.KERNELS[name]
    return dispatch._load(entry.tilelang if impl == "loong" else entry.reference)


def attention_case(t: dict[str, torch.Tensor], shape: str) -> Case:
    q, kv, idx, dout = t["q"], t["kv"], t["idx"], t["dout"]
    scale = q.shape[-1] ** -0.5
    case = Case(f"DSA sparse MLA fwd+bwd {shape}")

    def ours(impl: str) -> Callable[[], list[torch.Tensor]]:
        fwd, bwd = _kernel("sparse_mla_fwd", impl), _kernel("sparse_mla_bwd", impl)

        def step() -> list[torch.Tensor]:
            out, lse = fwd(q, kv, idx, D_V, scale)
            dq, dkv = bwd(q, kv, out, dout, idx, lse, D_V, scale)
            return [out, dq, dkv]

        return step

    case.steps = _stacks(ours, (lambda: megatron_attention(q, kv, idx, dout, scale)) if q.is_cuda else None)
    return case


def megatron_attention(q, kv, idx, dout, scale: float) -> Callable[[], list[torch.Tensor]]:
    """megatron-core's SparseMLA autograd function on the same tensors (its [B, T, G, ...] layout)."""
    from megatron.core.transformer.experimental_attention_variant.ops.sparse_mla import SparseMLA

    if SparseMLA is None:
        raise RuntimeError("megatron-core's SparseMLA is unavailable (tilelang does not import)")
    seq, d_qk = kv.shape
    idx4 = idx.to(torch.int32).view(1, seq, 1, -1).contiguous()

    def step() -> list[torch.Tensor]:
        qb = q.unsqueeze(0).detach().requires_grad_()
        kvb = kv.view(1, seq, 1, d_qk).detach().requires_grad_()
        out, _ = SparseMLA.apply(qb, kvb, idx4, scale)
        dq, dkv = torch.autograd.grad(out, [qb, kvb], dout.unsqueeze(0))
        return [out[0], dq[0], dkv[0, :, 0]]

    return step


def indexer_case(t: dict[str, torch.Tensor], topk: int, shape: str) -> Case:
    q_i, k_i, w, starts = t["q_i"], t["k_i"], t["w"], t["starts"]
    case = Case(f"DSA indexer top-k {shape}")

    def ours(impl: str) -> Callable[[], list[torch.Tensor]]:
        scores = _kernel("indexer_scores", impl)
        return lambda: [ref_dsa.topk_indices(scores(q_i, k_i, w, starts), topk)]

    case.steps = _stacks(ours, (lambda: megatron_indexer(q_i, k_i, w, starts, topk)) if q_i.is_cuda else None)
    return case


def _or_raise(build: Callable[[], Callable]) -> Callable:
    """The built step, or one that raises the build's error (a missing baseline is a row's error)."""
    try:
        return build()
    except (ImportError, RuntimeError) as e:
        error = e

        def raises() -> list[torch.Tensor]:
            raise error

        return raises


def megatron_indexer(q_i, k_i, w, starts, topk: int) -> Callable[[], list[torch.Tensor]]:
    """megatron-core's fused TileLang indexer hook as its DSA layer calls it (``run_fused_qk_topk``:
    lightning-indexer scores + top-k over query blocks of 8192, keys outside [starts[t], t] -> -1)."""
    from loong_kernels import megatron_dsa

    reason = megatron_dsa.indexer_topk_blocker(q_i, k_i, w, starts, topk)
    if reason is not None:
        raise RuntimeError(reason)
    return lambda: [megatron_dsa.indexer_topk(q_i, k_i, w, starts, topk)]


def dispatch_decision(t: dict[str, torch.Tensor], topk: int) -> str:
    """The decision tables of a fresh dispatcher for this shape's sparse MLA and indexer top-k
    (what training would run)."""
    q, kv, idx = t["q"], t["kv"], t["idx"].to(torch.int32).contiguous()
    chooser = dispatch.Dispatcher()
    try:
        chooser.choose_op("sparse_mla", q, kv, idx, D_V, q.shape[-1] ** -0.5)
        chooser.choose_op("indexer_topk", t["q_i"], t["k_i"], t["w"], t["starts"], topk)
    except Exception as e:  # reported, the bench's own rows still stand
        return f"dispatch failed: {type(e).__name__}: {e}"
    return "\n".join(autotune.format_decision(d) for d in chooser.autotuner.cache.values())


def run(case: Case, iters: int, check: Callable, tol: float) -> list[Row]:
    """Every implementation of ``case`` (the float32 reference first), timed and checked."""
    rows, ref = [], None
    for impl in ["reference", *[i for i in IMPLS if i != "reference" and i in case.steps]]:
        row = Row(case.name, impl)
        try:
            row.ms, row.peak_mib, out = (
                _measure(case.steps[impl], iters) if iters else (None, None, case.steps[impl]())
            )
            ref = out if impl == "reference" else ref
            row.max_diff = None if impl == "reference" else check(out, ref)
            if row.max_diff is not None and not row.max_diff <= tol:
                row.error = f"differs from the float32 reference: {row.max_diff:.3g} > {tol}"
        except Exception as e:  # reported in the table, and the run exits 1
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append(row)
    return rows


def speedups(rows: list[Row]) -> list[str]:
    """Loong / megatron-core time ratio per case."""
    by = {(r.case, r.impl): r for r in rows}
    lines = []
    for case in dict.fromkeys(r.case for r in rows):
        ours, theirs = by.get((case, "loong")), by.get((case, "megatron"))
        if ours and theirs and ours.ms and theirs.ms and not (ours.error or theirs.error):
            lines.append(f"{case}: Loong {theirs.ms / ours.ms:.2f}x megatron-core")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["8192x128x2048"], help="TxHxK: tokens, heads, top-k")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rtol", type=float, default=2e-2, help="max |diff| / max |ref| of the attention tensors")
    p.add_argument(
        "--max-miss", type=float, default=0.01, help="indexer: fraction of keys the reference did not pick"
    )
    args = p.parse_args(argv)
    shapes = [parse_shape(s) for s in args.shapes]
    if not torch.cuda.is_available():
        print("bench/dsa_vs_megatron.py needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows: list[Row] = []
    decisions: list[str] = []
    for seq, heads, topk in shapes:
        t = _dsa_inputs(seq, heads, IDX_HEADS, topk)
        shape = f"[T={seq} H={heads} topk={topk}]"
        for case, check, tol in ((attention_case(t, shape), rel_diff, args.rtol),
                                 (indexer_case(t, topk, shape), missed_fraction, args.max_miss)):  # fmt: skip
            print(f"running {case.name} ...", file=sys.stderr, flush=True)
            rows.extend(run(case, args.iters, check, tol))
            torch.cuda.empty_cache()
        decisions.append(dispatch_decision(t, topk))
        del t
    print_rows(rows)
    print("\n".join(speedups(rows)))
    print("\n".join(["", "dispatch (sparse MLA, indexer top-k; fresh dispatcher per shape):", *decisions]))
    bad = [f"{r.case} [{r.impl}]: {r.error}" for r in rows if r.error]
    if bad:
        print("failed:\n  " + "\n  ".join(bad))
    return 1 if bad else 0


def print_rows(rows: list[Row]) -> None:
    """ms, speed against the float32 reference, peak MiB and the check's value (rel. diff or missed keys)."""
    ref = {r.case: r for r in rows if r.impl == "reference"}
    print(f"\n{'case':<52} {'impl':<15} {'ms':>9} {'x ref':>7} {'peak MiB':>9} {'check':>9}")
    for r in rows:
        base = ref.get(r.case)
        speed = f"{base.ms / r.ms:7.2f}" if base and base.ms and r.ms else f"{'-':>7}"
        ms = f"{r.ms:9.3f}" if r.ms is not None else f"{'-':>9}"
        peak = f"{r.peak_mib:9.1f}" if r.peak_mib is not None else f"{'-':>9}"
        check = f"{r.max_diff:9.3g}" if r.max_diff is not None else f"{'-':>9}"
        print(
            f"{r.case:<52} {r.impl:<15} {ms} {speed} {peak} {check}"
            + (f"  ERROR {r.error}" if r.error else "")
        )


if __name__ == "__main__":
    sys.exit(main())
