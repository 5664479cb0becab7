"""Measure where FP8 beats BF16 for a model's own TE linears and write an adaptive-FP8 policy.

For each GEMM kind of the model (qkv, proj, fc1, fc2), each TP size and each token count, one TE
layer of the model's rank-local shape at that TP size (``LayerNormLinear`` for qkv / fc1 with
the model's norm, ``Linear`` for proj / fc2: the classes megatron's TE spec wraps) runs forward +
backward in BF16 and under the FP8 recipe; the median of CUDA-event times per precision gives the
speedup. The threshold of a (kind, TP) is the smallest token count from which every larger
measured count wins by ``--speedup-threshold`` (loong_models.precision.min_winning_tokens).
The policy names the GPU, the TE version and the recipe, so a run on another GPU or recipe
refuses it (``model.foundation.precision.policy``).

TP is simulated on one GPU: the layer has the shard's shape, so the time is one rank's GEMMs
without the TP collectives (which FP8 does not change). MoE expert GEMMs are not swept yet.

    python bench/fp8_policy.py --model llama3.2-1b --recipe blockwise --tp 1 2 4 --out fp8_policy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass

from loong_models import FoundationConfig, load_model_config
from loong_models.precision import Fp8Policy, Rule, min_winning_tokens

DEFAULT_TOKENS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
# GEMM kind -> the TE layer kind of LoongForge's policy schema (the class megatron's spec uses)
LAYER_KINDS = {"qkv": "layernorm_column", "fc1": "layernorm_column", "proj": "row", "fc2": "row"}


@dataclass(frozen=True)
class Gemm:
    kind: str  # qkv | proj | fc1 | fc2
    in_features: int
    out_features: int

    @property
    def with_norm(self) -> bool:
        return LAYER_KINDS[self.kind] == "layernorm_column"


def gemm_shapes(f: FoundationConfig, tp: int) -> list[Gemm]:
    """One TP rank's linears of a dense GQA layer: column-parallel outputs and row-parallel
    inputs are split by ``tp``."""
    if f.mla is not None or f.moe is not None:
        raise SystemExit("bench/fp8_policy.py sweeps dense GQA layers; MLA / MoE kinds are not swept yet")
    h, d = f.hidden_size, f.head_dim
    q, kv = f.num_attention_heads * d, f.query_groups * d
    for name, size in (("heads", f.num_attention_heads), ("KV groups", f.query_groups), ("ffn", f.ffn_hidden_size)):
        if size % tp:
            raise SystemExit(f"--tp {tp} does not divide the model's {name} ({size})")
    return [Gemm("qkv", h, (q + 2 * kv) // tp), Gemm("proj", q // tp, h),
            Gemm("fc1", h, 2 * f.ffn_hidden_size // tp), Gemm("fc2", f.ffn_hidden_size // tp, h)]  # fmt: skip


def policy_from_sweep(sweep: dict[str, dict[int, list[tuple[int, float, float]]]], *, threshold: float,
                      gpu_name: str, te_version: str, recipe: str, path: str = "") -> Fp8Policy:  # fmt: skip
    """``sweep[kind][tp]`` = [(tokens, bf16 ms, fp8 ms), ...] -> the policy; a rule's
    ``measured_speedup`` is the speedup at the largest measured token count."""
    rules: dict[str, dict[str, list[Rule]]] = {}
    for kind, by_tp in sweep.items():
        for tp, points in sorted(by_tp.items()):
            speedups = [(n, bf16 / fp8) for n, bf16, fp8 in points]
            rule = Rule(tp, min_winning_tokens(speedups, threshold), round(max(speedups)[1], 4))
            rules.setdefault(LAYER_KINDS[kind], {}).setdefault(kind, []).append(rule)
    return Fp8Policy(path, gpu_name, te_version, recipe, threshold, rules)


def te_recipe(name: str):
    from transformer_engine.common import recipe

    return {"tensorwise": lambda: recipe.Float8CurrentScaling(), "blockwise": lambda: recipe.Float8BlockScaling(),
            "delayed": lambda: recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID),
            "mxfp8": lambda: recipe.MXFP8BlockScaling()}[name]()  # fmt: skip


def time_gemm(g: Gemm, tokens: int, fp8_recipe, *, iters: int, warmup: int, eps: float) -> float:
    """Median ms of one forward + backward of the layer on ``tokens`` rows (FP8 when a recipe is given)."""
    import torch
    import transformer_engine.pytorch as te

    kw = dict(bias=False, params_dtype=torch.bfloat16, device="cuda")
    layer = (te.LayerNormLinear(g.in_features, g.out_features, normalization="RMSNorm", eps=eps, **kw)
             if g.with_norm else te.Linear(g.in_features, g.out_features, **kw))  # fmt: skip
    x = torch.randn(tokens, g.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, g.out_features, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with te.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
            y = layer(x)
        y.backward(grad)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
        x.grad = None
        layer.zero_grad(set_to_none=True)
    return statistics.median(times)


def sweep_model(args) -> dict[str, dict[int, list[tuple[int, float, float]]]]:
    f = load_model_config(args.model, args.override).foundation
    recipe = te_recipe(args.recipe)
    sweep: dict[str, dict[int, list[tuple[int, float, float]]]] = {}
    for tp in args.tp:
        for g in gemm_shapes(f, tp):
            for n in args.tokens:
                bf16 = time_gemm(g, n, None, iters=args.iters, warmup=args.warmup, eps=f.norm_epsilon)
                fp8 = time_gemm(g, n, recipe, iters=args.iters, warmup=args.warmup, eps=f.norm_epsilon)
                sweep.setdefault(g.kind, {}).setdefault(tp, []).append((n, bf16, fp8))
                print(f"tp={tp} {g.kind:<5} {g.in_features}->{g.out_features} tokens={n:>6}: bf16 {bf16:8.3f} ms  "
                      f"{args.recipe} {fp8:8.3f} ms  speedup {bf16 / fp8:5.2f}x", flush=True)  # fmt: skip
    return sweep


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.2-1b", help="a zoo name (loong_models.zoo_names)")
    p.add_argument("--override", nargs="*", default=[], help="model overrides, e.g. foundation.num_layers=4")
    p.add_argument("--recipe", default="blockwise", choices=["tensorwise", "blockwise", "delayed", "mxfp8"])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    p.add_argument("--speedup-threshold", type=float, default=1.02)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="fp8_policy.json")
    args = p.parse_args(argv)
    if min(args.tp) < 1 or min(args.tokens) < 1 or args.iters < 1:
        p.error("--tp, --tokens and --iters must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    import transformer_engine

    if not torch.cuda.is_available():
        sys.exit("bench/fp8_policy.py measures GPU kernels: it needs CUDA and transformer-engine")
    sweep = sweep_model(args)
    policy = policy_from_sweep(sweep, threshold=args.speedup_threshold, gpu_name=torch.cuda.get_device_name(),
                               te_version=str(transformer_engine.__version__), recipe=args.recipe, path=args.out)  # fmt: skip
    written = {**policy.to_dict(), "sweep": {k: {str(tp): pts for tp, pts in by_tp.items()} for k, by_tp in sweep.items()}}
    with open(args.out, "w") as fh:  # the measurements beside the rules (load_policy ignores them)
        json.dump(written, fh, indent=1)
    print(json.dumps({"policy": args.out, "rules": written["rules"]}, indent=1))


if __name__ == "__main__":
    main()
