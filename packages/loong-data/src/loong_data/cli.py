"""The ``loong-data`` command line: one subcommand per data task."""

import argparse
import logging
import sys
from pathlib import Path

from loong_data.bundled import default_tokenizer
from loong_data.prepare import DEFAULT_SEED, prepare_text_dataset


def _tokenize(args: argparse.Namespace) -> int:
    corpus = prepare_text_dataset(args.sources, args.tokenizer, args.out, val_fraction=args.val_fraction,
                                  seed=args.seed, progress=not args.quiet)
    state = "reused (fingerprint matches)" if corpus.reused else "written"
    print(f"{corpus.out_dir}: {state}, fingerprint {corpus.fingerprint[:12]}")
    for name, split in (("train", corpus.train), ("val", corpus.val)):
        print(f"  {name}: {split.num_tokens:,} tokens, {split.num_docs:,} documents, {split.dtype} -> {split.bin_path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loong-data", description="Loong data tools.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tokenize = commands.add_parser(
        "tokenize", help="tokenise .txt / .jsonl documents into train/val token files",
        description="Tokenise documents (a folder, .txt files: one document each, .jsonl files: one "
                    'document per line in its "text" field) into OUT/{train,val}.bin + .idx.json.')
    tokenize.add_argument("sources", nargs="+", type=Path, metavar="SOURCES")
    tokenize.add_argument("--tokenizer", type=Path, default=default_tokenizer(),
                          help="tokenizer.json or a folder holding one (default: the bundled Shakespeare BPE)")
    tokenize.add_argument("--out", type=Path, required=True, help="output folder")
    tokenize.add_argument("--val-fraction", type=float, default=0.02, help="share of documents for val")
    tokenize.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the train/val split")
    tokenize.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    tokenize.set_defaults(run=_tokenize)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if getattr(args, "quiet", False) else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except (FileNotFoundError, ValueError) as e:
        # Input errors are the user's to fix: show the message, not a traceback.
        print(f"loong-data {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
