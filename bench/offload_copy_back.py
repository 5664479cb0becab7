"""The step of megatron's host-offloaded optimizer (HybridDeviceOptimizer, Loong's
optim.offload_fraction) as megatron builds it, against loong_xpu's manifest patches: the pinned
copy of the updated weights back to the GPU (loong_xpu.offload_copy_back), first with megatron's
one host AdamW per tensor, then with one per bucket of tensors (loong_xpu.offload_buckets), then
with the host state streamed through the GPU and updated there (loong_xpu.offload_device_update,
optim.offload_update=device), then the same with the moments kept in bf16 (optim.state_dtype=bf16),
on one GPU.

All variants build the optimizer the way megatron's precision-aware distributed optimizer does
(bf16 weights, fp32 gradients in ``decoupled_grad``, fp32 update, copies on side streams, fused
AdamW on the host) over the same weights and gradients; each step is timed to the GPU's end, the
median after --warmup steps is reported, and the host variants' weights must come out bit for
bit the same; the device update's (CUDA's build of the same fused AdamW) may differ in the last bit
of a few weights (>= 99.9% equal), with bf16 moments in a few more (>= 99%).

    python bench/offload_copy_back.py                     # 0.78B parameters: one EP=4 rank of
                                                          # qwen3-30b-a3b x 4 layers
    python bench/offload_copy_back.py --params 1.55e9 --tensors 528  # one EP=2 rank's tensors
    python bench/offload_copy_back.py --params 1e8 --steps 4 --warmup 1
    for i in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$i python bench/offload_copy_back.py --threads 16 \
        --variants "pinned + buckets" "device update" & done; wait   # four ranks' host at once

Measured on H200s:
- one GPU, 16 host threads, 0.78B parameters, before the buckets: megatron 0.736 s a step, pinned
  copy-back 0.251 s;
- ``--params 1.55e9 --tensors 528 --threads 16`` in two processes at once, one per GPU of a 2-GPU
  host: megatron 1.509 / 1.492 s, pinned copy-back 0.533 / 0.656 s, pinned + buckets 0.432 / 0.429 s;
- ``--threads 16 --variants "pinned + buckets" "device update"`` in four processes at once, one per
  GPU of a 4-GPU host (0.78B parameters each): pinned + buckets 0.347 / 0.351 / 0.226 / 0.401 s,
  device update 0.248 / 0.249 / 0.190 / 0.261 s, 99.9996% of the weights equal in each;
- ``--params 3.1e9 --tensors 1040 --variants "device update" "device update, bf16 moments" --steps 5
  --warmup 2`` on one H200 (one EP=1 rank): 0.810 s, bf16 moments 0.552 s (1.466x), 99.97% of the
  weights equal after 5 steps.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import time

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=0.78e9, help="parameters updated by the optimizer")
    p.add_argument("--tensors", type=int, default=64, help="tensors they are split into")
    p.add_argument("--offload-fraction", type=float, default=1.0, help="share of them updated on the host")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    p.add_argument("--threads", type=int, default=None, help="host threads for the update (default: all cores)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="the first one is the reference the others are compared with")  # fmt: skip
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if not 0 < args.offload_fraction <= 1:
        p.error(f"--offload-fraction {args.offload_fraction} must be in (0, 1]")
    if args.tensors < 1 or args.params < args.tensors:
        p.error(f"--params {args.params:g} must be at least --tensors {args.tensors}")
    return args


# name: (the manifest applied, elements per host optimizer; 0: one per tensor, as megatron builds
# them; the offloaded share updated on the device with its moments in this dtype, None: on the host)
VARIANTS = {"megatron": (False, 0, None), "pinned copy-back": (True, 0, None), "pinned + buckets": (True, None, None),
            "device update": (True, None, torch.float32), "device update, bf16 moments": (True, None, torch.bfloat16)}  # fmt: skip


def run(args: argparse.Namespace, patched: bool, bucket: int | None,
        moments: torch.dtype | None) -> tuple[list[float], list[torch.Tensor]]:  # fmt: skip
    """Step times (s) and the final bf16 weights of one variant."""
    from loong_xpu import get_accelerator, offload_buckets, redirect_cuda
    from loong_xpu.offload_device_update import update_on_device
    from loong_xpu.testing import hybrid_device_optimizer

    numel = int(args.params) // args.tensors
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=g, device="cuda").bfloat16()) for _ in range(args.tensors)]
    default = offload_buckets.BUCKET
    offload_buckets.BUCKET = default if bucket is None else bucket  # read as the optimizer is built
    try:
        opt = hybrid_device_optimizer(params, args.offload_fraction, patched=patched, lr=1e-4)
    finally:
        offload_buckets.BUCKET = default
    times = []
    with redirect_cuda(get_accelerator("cuda")) if moments is not None else contextlib.nullcontext():  # the step patch
        if moments is not None:
            update_on_device(opt, moments)
        for _ in range(args.steps):
            for p in params:
                p.decoupled_grad = torch.randn(numel, generator=g, device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    weights = [p.detach().clone() for p in params]
    del opt, params
    gc.collect()
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()  # the pinned host blocks too: each variant pins its own ~16 B a parameter
    return times, weights


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/offload_copy_back.py needs a CUDA GPU (megatron's HybridDeviceOptimizer copies on CUDA streams)")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    print(f"{args.params / 1e9:.2f}B parameters in {args.tensors} tensors, offload fraction {args.offload_fraction}, "
          f"{torch.get_num_threads()} host threads, {torch.cuda.get_device_name()}", flush=True)  # fmt: skip
    results = {}
    for name in args.variants:
        times, weights = run(args, *VARIANTS[name])
        results[name] = (statistics.median(times[args.warmup :]), weights)
        print(f"{name:20s} median step {results[name][0]:.3f} s  (steps {', '.join(f'{t:.3f}' for t in times)})", flush=True)
    reference = args.variants[0]
    base, theirs = results[reference]
    ok = True
    for name, (step_s, ours) in list(results.items())[1:]:
        equal = sum(int((a == b).sum()) for a, b in zip(theirs, ours, strict=True)) / sum(a.numel() for a in theirs)
        # the same update in the same place: bit for bit; CUDA's build of the host's kernel may round
        # a few weights apart; moments rounded to bf16 each step a few more
        mine, ref = VARIANTS[name][2], VARIANTS[reference][2]
        good = equal == 1.0 if mine == ref else equal > 0.99 if torch.bfloat16 in (mine, ref) else equal > 0.999
        ok &= good
        print(f"{name}: {base / step_s:.3f}x the speed of {reference}'s step ({base - step_s:.3f} s a step saved); "
              f"weights equal to {reference}'s after {args.steps} steps: {equal:.6f} ({'ok' if good else 'NOT OK'})")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
