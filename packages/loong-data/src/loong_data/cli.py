"""The ``loong-data`` command line: one subcommand per data task."""

import argparse
import logging
import sys
from pathlib import Path

from loong_data.bundled import default_tokenizer
from loong_data.prepare import DEFAULT_SEED, prepare_text_dataset


def _tokenize(args: argparse.Namespace) -> int:
    corpus = prepare_text_dataset(
        args.sources,
        args.tokenizer,
        args.out,
        val_fraction=args.val_fraction,
        seed=args.seed,
        progress=not args.quiet,
    )
    state = "reused (fingerprint matches)" if corpus.reused else "written"
    print(f"{corpus.out_dir}: {state}, fingerprint {corpus.fingerprint[:12]}")
    for name, split in (("train", corpus.train), ("val", corpus.val)):
        print(
            f"  {name}: {split.num_tokens:,} tokens, {split.num_docs:,} documents, {split.dtype} -> {split.bin_path}"
        )
    return 0


def _convert_to_webdataset(args: argparse.Namespace) -> int:
    from loong_data.multimodal.convert import convert_to_webdataset

    report = convert_to_webdataset(
        args.inputs,
        args.out,
        media_root=args.media_root,
        maxcount=args.maxcount,
        maxsize=args.maxsize,
        on_error=args.on_error,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(report.counts.items()))
    print(
        f"{report.out_dir}: {report.num_samples:,} samples ({kinds}) in {len(report.shards)} shards, "
        f"{report.num_skipped:,} bad records skipped"
    )
    for error in report.errors:
        print(f"  skipped {error}", file=sys.stderr)
    return 0


def _diffusion_prepare(args: argparse.Namespace) -> int:
    import json

    from loong_data.diffusion import bundled_captioned_media, prepare_diffusion_shards
    from loong_data.diffusion.media import jsonl_captioned_media
    from loong_data.diffusion.prepare import TINY_TEXT_ENCODER, TINY_VAE

    items = jsonl_captioned_media(args.input) if args.input else bundled_captioned_media(clips=not args.no_clips)
    res = prepare_diffusion_shards(
        items, args.out, vae=json.loads(args.vae) if args.vae else TINY_VAE,
        text_encoder=json.loads(args.text_encoder) if args.text_encoder else TINY_TEXT_ENCODER,
        text_len=args.text_len, size=args.size, seed=args.seed, tokenizer=args.tokenizer,
        vae_dir=args.vae_dir, text_dir=args.text_encoder_dir,
    )  # fmt: skip
    state = "reused (fingerprint matches)" if res.reused else "written"
    print(f"{res.out_dir}: {res.meta['num_samples']} samples in {len(res.meta['shards'])} shards, {state}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loong-data", description="Loong data tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tokenize = commands.add_parser(
        "tokenize",
        help="tokenise .txt / .jsonl documents into train/val token files",
        description="Tokenise documents (a folder, .txt files: one document each, .jsonl files: one "
        'document per line in its "text" field) into OUT/{train,val}.bin + .idx.json.',
    )
    tokenize.add_argument("sources", nargs="+", type=Path, metavar="SOURCES")
    tokenize.add_argument(
        "--tokenizer",
        type=Path,
        default=default_tokenizer(),
        help="tokenizer.json or a folder holding one (default: the bundled Shakespeare BPE)",
    )
    tokenize.add_argument("--out", type=Path, required=True, help="output folder")
    tokenize.add_argument("--val-fraction", type=float, default=0.02, help="share of documents for val")
    tokenize.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the train/val split")
    tokenize.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    tokenize.set_defaults(run=_tokenize)

    convert = commands.add_parser(
        "convert-to-webdataset",
        help="JSON/JSONL conversations + media -> WebDataset tar shards",
        description="Write conversations (.jsonl: one per line, .json: a list) whose messages reference "
        "images / videos (folders or lists of frames) by relative path to OUT/shard-%%06d.tar + "
        "manifest.json. Every media file is decoded to check it. Output is atomic: OUT appears "
        "complete or not at all.",
    )
    convert.add_argument("inputs", nargs="+", type=Path, metavar="INPUTS")
    convert.add_argument("--out", type=Path, required=True, help="output folder of the shards")
    convert.add_argument(
        "--media-root",
        type=Path,
        default=None,
        help="folder media paths are relative to (default: each input file's folder)",
    )
    convert.add_argument("--maxcount", type=int, default=1000, help="samples per shard at most")
    convert.add_argument(
        "--maxsize",
        type=int,
        default=1 << 30,
        help="bytes per shard file at most (a larger sample gets a shard of its own)",
    )
    convert.add_argument(
        "--on-error",
        choices=("skip", "stop"),
        default="skip",
        help="bad record: skip it (listed at the end) or stop with no output",
    )
    convert.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    convert.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    convert.set_defaults(run=_convert_to_webdataset)

    diff = commands.add_parser(
        "diffusion-prepare",
        help="captioned images / clips -> WebDataset shards of VAE latents + text embeddings",
        description="Encode captioned media (default: the bundled photos, digits and clips; or a JSONL of "
        '{"media": path or [frame paths], "caption": text}) with a Wan VAE (diffusers AutoencoderKLWan) and '
        "a UMT5 text encoder into OUT/shard-*.tar + meta.json; the towers are saved under OUT/towers.",
    )
    diff.add_argument("--out", type=Path, required=True, help="output folder")
    diff.add_argument("--input", type=Path, help="JSONL of captioned media (default: the bundled set)")
    diff.add_argument("--no-clips", action="store_true", help="bundled set: images only")
    diff.add_argument("--size", type=int, default=32, help="frame side in pixels (resize + centre crop)")
    diff.add_argument("--text-len", type=int, default=32, help="text tokens per caption (Wan: 512)")
    diff.add_argument("--vae", help="AutoencoderKLWan kwargs as JSON (default: the tiny random VAE)")
    diff.add_argument("--text-encoder", help="UMT5Config fields as JSON (default: the tiny random encoder)")
    diff.add_argument("--vae-dir", help="a diffusers AutoencoderKLWan directory (instead of --vae)")
    diff.add_argument("--text-encoder-dir", help="an HF UMT5EncoderModel directory (instead of --text-encoder)")
    diff.add_argument("--tokenizer", help="tokenizer folder (default: the bundled SentencePiece, 32000 pieces)")
    diff.add_argument("--seed", type=int, default=0, help="seed of the random towers")
    diff.set_defaults(run=_diffusion_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if getattr(args, "quiet", False) else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError) as e:
        # Input errors are the user's to fix: show the message, not a traceback.
        print(f"loong-data {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
