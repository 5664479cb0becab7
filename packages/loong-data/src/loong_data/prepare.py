"""Tokenise text sources into train/val token files, once: a fingerprint decides when to redo it."""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from loong_data.errors import DataError
from loong_data.log import logger
from loong_data.sources import Sources, count_documents, iter_documents, resolve_sources
from loong_data.token_file import VERSION, TokenFile, TokenWriter, dtype_for_vocab, split_paths
from loong_data.tokenizer import TextTokenizer, load_tokenizer

SPLITS = ("train", "val")
DEFAULT_SEED = 1234


@dataclass(frozen=True)
class TokenizedCorpus:
    """The result of :func:`prepare_text_dataset`."""

    out_dir: Path
    train: TokenFile
    val: TokenFile
    fingerprint: str
    reused: bool  # True when matching files already existed and nothing was tokenised


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(files: list[Path], tokenizer: TextTokenizer, val_fraction: float, seed: int) -> str:
    """Hash of everything the output depends on. Source contents (not names or mtimes) count, so
    moving a corpus keeps the cache while editing one byte invalidates it."""
    key = {
        "version": VERSION,
        "tokenizer": sha256_file(tokenizer.path),
        "eod_id": tokenizer.eod_id,
        "sources": [sha256_file(f) for f in files],
        "val_fraction": val_fraction,
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def val_documents(num_docs: int, val_fraction: float, seed: int) -> set[int]:
    """Indices of the whole documents that go to val: the head of a seeded permutation, at least
    one document when there are two or more (and val_fraction > 0), never all of them."""
    if num_docs < 2 or val_fraction == 0:
        return set()
    num_val = min(num_docs - 1, max(1, round(num_docs * val_fraction)))
    return set(np.random.default_rng(seed).permutation(num_docs)[:num_val].tolist())


def _existing(out_dir: Path, fp: str) -> TokenizedCorpus | None:
    try:
        train, val = (TokenFile(out_dir / split) for split in SPLITS)
    except (FileNotFoundError, ValueError) as e:
        logger.debug("no reusable tokens in %s: %s", out_dir, e)
        return None
    if train.fingerprint != fp or val.fingerprint != fp:
        logger.info("sources or tokenizer changed since %s was written; tokenising again", out_dir)
        return None
    return TokenizedCorpus(out_dir, train, val, fp, reused=True)


def prepare_text_dataset(
    sources: Sources,
    tokenizer: TextTokenizer | str | Path,
    out_dir: str | Path,
    *,
    val_fraction: float = 0.02,
    seed: int = DEFAULT_SEED,
    progress: bool = True,
) -> TokenizedCorpus:
    """Tokenise documents into ``out_dir/{train,val}.bin`` + ``.idx.json`` and return readers.

    ``sources``: a folder (its ``.txt`` and ``.jsonl`` files, sorted by name), or a list of
    ``.txt`` / ``.jsonl`` files. A ``.txt`` file is one document; each line of a ``.jsonl`` file
    is one document, its ``"text"`` field. Every document ends with the tokenizer's EOD.

    Whole documents go to train or val by a seeded permutation (at least one to val when there
    are >= 2); a single document is split at the end of its token stream instead. If files with
    the same fingerprint (sources, tokenizer, split settings) exist, they are returned as they are.
    Writes are atomic: the indexes appear only once their .bin files are complete.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    tok = tokenizer if isinstance(tokenizer, TextTokenizer) else load_tokenizer(tokenizer)
    files = resolve_sources(sources)
    fp = fingerprint(files, tok, val_fraction, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if (corpus := _existing(out_dir, fp)) is not None:
        logger.info("reusing tokens in %s (fingerprint %s)", out_dir, fp[:12])
        return corpus

    num_docs = count_documents(files)
    if num_docs == 0:
        raise DataError(f"no documents in {', '.join(map(str, files))}")
    to_val = val_documents(num_docs, val_fraction, seed)
    dtype = dtype_for_vocab(tok.vocab_size)
    meta = {"fingerprint": fp, "tokenizer": str(tok.path), "vocab_size": tok.vocab_size, "eod_id": tok.eod_id,
            "sources": [str(f) for f in files]}  # for error messages: the user's files, not the cache
    logger.info("tokenising %d documents from %d files into %s", num_docs, len(files), out_dir)
    with TokenWriter(out_dir / "train", dtype) as train, TokenWriter(out_dir / "val", dtype) as val:
        docs = tqdm(iter_documents(files), total=num_docs, unit="doc", desc="tokenize", disable=not progress)
        for i, doc in enumerate(docs):
            if not isinstance(doc.text, str):
                raise DataError(f"{doc.where}: document text must be a string, got {type(doc.text).__name__}")
            ids = tok.encode(doc.text) + [tok.eod_id]
            if num_docs == 1 and val_fraction > 0 and len(ids) >= 2:
                num_val = min(len(ids) - 1, max(1, round(len(ids) * val_fraction)))
                train.add(ids[:-num_val])
                val.add(ids[-num_val:])
            else:
                (val if i in to_val else train).add(ids)
        # Drop the old indexes before publishing anything, so that a crash between the renames
        # below cannot leave a train/val pair that looks complete but mixes two runs.
        for split in SPLITS:
            split_paths(out_dir / split)[1].unlink(missing_ok=True)
        train.commit({**meta, "split": "train"})
        val.commit({**meta, "split": "val"})

    corpus = TokenizedCorpus(out_dir, TokenFile(out_dir / "train"), TokenFile(out_dir / "val"), fp, reused=False)
    logger.info("wrote %d train tokens (%d docs), %d val tokens (%d docs) to %s",
                corpus.train.num_tokens, corpus.train.num_docs, corpus.val.num_tokens, corpus.val.num_docs, out_dir)
    return corpus
