"""Peak RSS and wall time of loong-convert on a randomly initialised ~1B HF Llama.

    uv run python packages/loong-ckpt/scripts/measure_1b.py /tmp/measure [--dtype bf16] [--layers 16]

Builds a Llama-3.2-1B-shaped model (hidden 2048, 32 heads / 8 KV heads, ffn 8192, vocab 128256, tied
embeddings) from ``LlamaConfig``, saves it with ``save_pretrained`` (1 GB shards), then runs both
directions of ``loong-convert`` in fresh processes and reports each one's peak RSS (getrusage) and
time, next to the RSS of a process that only imports the converter (torch + megatron-core).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _run(cmd: list[str]) -> tuple[float, float]:
    code = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        f"r = subprocess.run({cmd!r}); "
        "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
        "print(f'{time.perf_counter() - t:.1f} {u.ru_maxrss / 1024:.0f}'); sys.exit(r.returncode)"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
    if p.returncode:
        sys.exit(p.stderr[-3000:])
    seconds, rss = p.stdout.split()[-2:]
    return float(seconds), float(rss)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    hf, ckpt, back = args.workdir / "hf", args.workdir / "ckpt", args.workdir / "hf-back"
    if not (hf / "config.json").is_file():
        import torch
        import transformers

        config = transformers.LlamaConfig(
            hidden_size=2048, intermediate_size=8192, num_hidden_layers=args.layers, num_attention_heads=32,
            num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
            rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
        )  # fmt: skip
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        t = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.save_pretrained(hf, max_shard_size="1GB")
        n = sum(p.numel() for p in model.parameters())
        print(f"built {n / 1e9:.2f}B-parameter Llama ({args.dtype}) in {time.perf_counter() - t:.0f}s -> {hf}")
        del model
    size = sum(f.stat().st_size for f in hf.glob("*.safetensors")) / 2**30
    convert = [sys.executable, "-m", "loong_ckpt.cli"]
    base = _run([sys.executable, "-c", "import loong_ckpt.convert, loong_models, megatron.core"])
    fwd = _run([*convert, "hf-to-mcore", str(hf), str(ckpt), "--force", "--no-progress"])
    rev = _run([*convert, "mcore-to-hf", str(ckpt), str(back), "--force", "--no-progress"])
    report = {
        "weights_gib": round(size, 2), "dtype": args.dtype, "layers": args.layers,
        "import_only": {"seconds": base[0], "peak_rss_mib": base[1]},
        "hf_to_mcore": {"seconds": fwd[0], "peak_rss_mib": fwd[1]},
        "mcore_to_hf": {"seconds": rev[0], "peak_rss_mib": rev[1]},
    }  # fmt: skip
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
