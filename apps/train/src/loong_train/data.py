"""Turning the data config into per-step micro-batches for this rank."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from loong_data import (
    DistributedBatchSampler,
    DocumentDataset,
    LogNormalLengths,
    PackedTextDataset,
    TextTokenizer,
    TokenFile,
    collate,
    default_corpus,
    default_tokenizer,
    load_tokenizer,
    packing_strategy,
    prepare_text_dataset,
)
from loong_data.bundled import default_chat_dataset
from loong_data.chat_text import ChatTextDataset
from loong_train.schema import DataConfig
from loong_train.thd import PackedDocuments, TrainBalancer


@dataclass
class TextData:
    tokenizer: TextTokenizer  # or a ChatTokenizer (data.kind=chat): both have vocab_size and path
    train: PackedTextDataset | PackedDocuments | ChatTextDataset
    val: PackedTextDataset | PackedDocuments | ChatTextDataset


def _packed_documents(cfg: DataConfig, split: TokenFile, tokenizer: TextTokenizer, seed: int) -> PackedDocuments:
    t = cfg.thd
    lengths = LogNormalLengths(median=t.median_length, sigma=t.sigma, long_fraction=t.long_fraction)
    docs = DocumentDataset(split, cfg.seq_length, lengths=lengths, seed=seed)
    return PackedDocuments(docs, cfg.seq_length, packing_strategy(t.strategy, t.buffer_size), tokenizer.pad_id)


def load_text_data(cfg: DataConfig, *, is_main: bool, seed: int) -> TextData:
    """Tokenise once (main rank; cached across runs), then open the same files on every rank."""
    if cfg.kind == "chat":
        return _chat_data(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer or default_tokenizer())
    sources = [Path(s) for s in cfg.sources] or [default_corpus()]
    kwargs = dict(val_fraction=cfg.val_fraction, seed=seed)
    if is_main:
        corpus = prepare_text_dataset(sources, tokenizer, Path(cfg.cache_dir), **kwargs)
    if dist.is_initialized():
        dist.barrier()
    if not is_main:
        corpus = prepare_text_dataset(sources, tokenizer, Path(cfg.cache_dir), **kwargs)  # cache hit
    if cfg.packing == "thd":
        return TextData(tokenizer, _packed_documents(cfg, corpus.train, tokenizer, seed),
                        _packed_documents(cfg, corpus.val, tokenizer, seed))
    return TextData(
        tokenizer,
        PackedTextDataset(corpus.train, cfg.seq_length),
        PackedTextDataset(corpus.val, cfg.seq_length),
    )


def _chat_data(cfg: DataConfig) -> TextData:
    """Conversations through the chat template (every rank tokenises them: seconds for thousands)."""
    from loong_data.multimodal import load_chat_tokenizer

    tokenizer = load_chat_tokenizer(cfg.tokenizer)
    sources = cfg.sources or [default_chat_dataset()]
    split = dict(val_fraction=cfg.val_fraction)
    return TextData(tokenizer, ChatTextDataset(sources, tokenizer, cfg.seq_length, split="train", **split),
                    ChatTextDataset(sources, tokenizer, cfg.seq_length, split="val", **split))  # fmt: skip


def microbatches(dataset: PackedTextDataset, sampler_step: list[list[int]]) -> list[dict]:
    return [collate([dataset[i] for i in mb]) for mb in sampler_step]


def step_batches(
    dataset: PackedTextDataset | PackedDocuments,
    *,
    micro_batch_size: int,
    num_microbatches: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    start_step: int = 0,
    balancer: TrainBalancer | None = None,
) -> Iterator[list[dict]]:
    """For each step from ``start_step``: this DP rank's micro-batches. For packed documents the
    rank's samples of the step (optionally rebalanced across DP ranks, a collective) are packed
    into as many micro-batches as they need."""
    sampler = DistributedBatchSampler(
        len(dataset),
        micro_batch_size=micro_batch_size,
        num_microbatches=num_microbatches,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        start_step=start_step,
    )
    for step_indices in sampler:
        if isinstance(dataset, PackedDocuments):
            yield dataset.step([i for mb in step_indices for i in mb], balancer)
        else:
            yield microbatches(dataset, step_indices)
