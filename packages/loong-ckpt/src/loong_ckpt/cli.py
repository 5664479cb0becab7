"""``loong-convert``: HF <-> Megatron checkpoints from the command line.

loong-convert hf-to-mcore <hf dir> <out dir> [--tp N] [--pp N] [--ep N] [--dtype auto|fp32|bf16|fp16]
loong-convert mcore-to-hf <checkpoint dir> <out dir> [--dtype ...] [--tokenizer DIR] [--fp8-blocks 128]
loong-convert mcore-to-peft <LoRA checkpoint dir> <out dir> [--base-model NAME]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from loong_xpu.log import quiet_megatron


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="loong-convert", description="Convert checkpoints between HF and Megatron."
    )
    sub = ap.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-mcore", help="HF directory -> Loong / megatron distributed checkpoint")
    a.add_argument("src", type=Path, help="HF directory (config.json + safetensors)")
    a.add_argument("out", type=Path, help="output checkpoint directory")
    a.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel size to validate and record (default 1)"
    )
    a.add_argument(
        "--pp", type=int, default=1, help="pipeline-parallel size to validate and record (default 1)"
    )
    a.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size (MoE) to validate and record (default 1)"
    )
    a.add_argument("--name", help="model name for the generated Loong YAML (default: the HF directory name)")
    b = sub.add_parser(
        "mcore-to-hf", help="Loong / megatron distributed checkpoint (any TP/PP) -> HF directory"
    )
    b.add_argument("src", type=Path, help="checkpoint directory (e.g. runs/x/checkpoints/step_00000100)")
    b.add_argument("out", type=Path, help="output HF directory")
    b.add_argument(
        "--tokenizer", type=Path, help="folder with tokenizer files to copy (default: the checkpoint's)"
    )
    b.add_argument(
        "--model-yaml", type=Path, help="foundation YAML, for checkpoints without loong.json metadata"
    )
    b.add_argument(
        "--max-shard-size", type=float, default=2.0, help="safetensors shard size in GiB (default 2)"
    )
    b.add_argument("--fp8-blocks", metavar="ROWS[,COLS]",
                   help="write the decoder's projection weights FP8 block-quantised (float8_e4m3fn + "
                        "weight_scale_inv per block, the DeepSeek-V3 / V3.2 release's layout), e.g. 128")  # fmt: skip
    for p in (a, b):
        p.add_argument("--dtype", default="auto", help="auto (keep), fp32, bf16 or fp16")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    c = sub.add_parser("mcore-to-peft", help="LoRA checkpoint (adapters only) -> PEFT adapter directory")
    c.add_argument("src", type=Path, help="LoRA checkpoint directory (a run with model.lora)")
    c.add_argument("out", type=Path, help="output adapter directory (adapter_config.json + safetensors)")
    c.add_argument("--base-model", help="base_model_name_or_path to record (default: the run's base weights)")
    for p in (a, b, c):
        p.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    quiet_megatron()
    logging.basicConfig(level=logging.WARNING, format="[loong-convert] %(levelname)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.ERROR)

    from loong_ckpt.convert import hf_to_mcore, mcore_to_hf
    from loong_ckpt.hf_config import ConversionError
    from loong_ckpt.safe_load import UnsafeCheckpointError

    try:
        if args.command == "mcore-to-peft":
            from loong_ckpt.peft import export_peft

            print(f"wrote {export_peft(args.src, args.out, base_model=args.base_model, force=args.force)}")
        elif args.command == "hf-to-mcore":
            res = hf_to_mcore(args.src, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype, name=args.name,
                              force=args.force, progress=not args.no_progress)  # fmt: skip
            print(
                f"wrote {res.path} ({res.tensors} tensors, {res.seconds:.1f}s, peak RSS {res.peak_rss_mib:.0f} MiB)"
            )
            if res.command:  # a diffusers Wan conversion has none (its model is model.diffusion)
                print(f"fine-tune from it (phase=finetune: a fine-tuning rate; phase=pretrain for pretraining rates):"
                      f"\n  {res.command}")  # fmt: skip
        else:
            from loong_ckpt.fp8_blocks import parse_block

            foundation = _load_foundation_yaml(args.model_yaml) if args.model_yaml else None
            blocks = parse_block(args.fp8_blocks) if args.fp8_blocks else None
            res = mcore_to_hf(args.src, args.out, dtype=args.dtype, tokenizer=args.tokenizer, foundation=foundation,
                              force=args.force, progress=not args.no_progress,
                              max_shard_bytes=int(args.max_shard_size * 2**30), fp8_blocks=blocks)  # fmt: skip
            print(
                f"wrote {res.path} ({res.tensors} tensors, {res.seconds:.1f}s, peak RSS {res.peak_rss_mib:.0f} MiB)"
            )
    except (ConversionError, UnsafeCheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _load_foundation_yaml(path: Path):
    from omegaconf import OmegaConf

    from loong_models import FoundationConfig

    raw = OmegaConf.load(path)
    raw.pop("defaults", None)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FoundationConfig), raw))
    cfg.validate()
    return cfg


if __name__ == "__main__":
    sys.exit(main())
