"""Train the bundled byte-level BPE tokenizer on a folder of ``.txt`` files.

    python -m loong_data.tools.train_tokenizer \\
        --out packages/loong-data/src/loong_data/tokenizers/shakespeare-bpe-8k/tokenizer.json

Deterministic: files are read in sorted order and the BPE trainer breaks ties between equally
frequent pairs by the pair itself, so the same corpus gives a byte-identical tokenizer.json.
"""

import argparse
import hashlib
import logging
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from loong_data.bundled import default_corpus
from loong_data.log import logger
from loong_data.tokenizer import EOD_TOKEN, PAD_TOKEN


def train_bpe(files: list[Path], vocab_size: int) -> Tokenizer:
    """A GPT-2 style byte-level BPE: every byte is in the alphabet, so no text is out of vocabulary."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets covering the leading space that byte-level tokens carry.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        # Special tokens first, so EOD is id 0 and pad id 1 whatever the corpus.
        special_tokens=[EOD_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(f) for f in files], trainer)
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loong_data.tools.train_tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=default_corpus(),
                        help="folder of .txt files (default: the bundled Shakespeare corpus)")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--out", type=Path, required=True, help="tokenizer.json to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    files = sorted(args.corpus.glob("*.txt"))
    if not files:
        parser.error(f"no .txt files in {args.corpus}")
    tokenizer = train_bpe(files, args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out), pretty=True)
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()
    logger.info("trained on %d files: vocab %d -> %s (sha256 %s)",
                len(files), tokenizer.get_vocab_size(), args.out, digest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
