"""Text step data (``data.kind`` text or chat): a tokenised corpus or chat conversations, cut into
fixed-length rows or packed variable-length documents (``data.packing=thd``, optionally moved
between DP ranks by a balancer)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch.distributed as dist

from loong_data.bundled import default_chat_dataset, default_corpus, default_tokenizer
from loong_data.chat_text import ChatTextDataset
from loong_data.collate import collate
from loong_data.documents import DocumentDataset
from loong_data.lengths import LogNormalLengths
from loong_data.packed import PackedTextDataset
from loong_data.packed_collate import collate_packed, padded_length
from loong_data.packing import PackingStrategy, packing_strategy
from loong_data.prepare import prepare_text_dataset
from loong_data.sampler import DistributedBatchSampler
from loong_data.step_data.config import DataConfig
from loong_data.step_data.layout import StepCounts, StepLayout, batch_digest
from loong_data.token_file import TokenFile
from loong_data.tokenizer import TextTokenizer, load_tokenizer

# What a packed document sample carries (position ids are rebuilt by collate_packed).
DOCUMENT_FIELDS = ("tokens", "labels", "loss_mask")


class Balancer(Protocol):
    """Moves samples between DP ranks so that their compute evens out (a collective);
    ``loong_parallel.balance.TrainBalancer`` is one."""

    def balance(self, samples: list[dict], lengths: np.ndarray) -> list[dict]: ...


@dataclass
class PackedDocuments:
    """A document dataset and how its samples are packed."""

    documents: DocumentDataset
    capacity: int
    strategy: PackingStrategy
    pad_id: int
    # Every document is padded to a multiple of this (context parallelism: 2 x cp chunks each).
    segment_multiple: int = 1

    def __len__(self) -> int:
        return len(self.documents)

    def step(self, indices: list[int], balancer: Balancer | None) -> list[dict[str, Any]]:
        samples = [{k: v for k, v in self.documents[i].items() if k in DOCUMENT_FIELDS} for i in indices]
        if balancer is not None:
            samples = balancer.balance(samples, self.documents.lengths[indices])
        lengths = [padded_length(int(s["tokens"].shape[0]), self.segment_multiple) for s in samples]
        packs = self.strategy.pack(lengths, self.capacity)
        return [collate_packed([samples[j] for j in pack], capacity=self.capacity, pad_id=self.pad_id,
                               segment_multiple=self.segment_multiple) for pack in packs]  # fmt: skip


def step_batches(dataset: PackedTextDataset | PackedDocuments | ChatTextDataset, *, micro_batch_size: int,
                 num_microbatches: int, dp_rank: int, dp_size: int, seed: int, start_step: int = 0,
                 balancer: Balancer | None = None) -> Iterator[list[dict]]:  # fmt: skip
    """For each step from ``start_step``: this DP rank's micro-batches. For packed documents the
    rank's samples of the step (optionally rebalanced across DP ranks, a collective) are packed
    into as many micro-batches as they need."""
    sampler = DistributedBatchSampler(
        len(dataset), micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
        dp_rank=dp_rank, dp_size=dp_size, seed=seed, start_step=start_step,
    )  # fmt: skip
    for step_indices in sampler:
        if isinstance(dataset, PackedDocuments):
            yield dataset.step([i for mb in step_indices for i in mb], balancer)
        else:
            yield [collate([dataset[i] for i in mb]) for mb in step_indices]


@dataclass
class TextStepData:
    """Step data of text and chat corpora (see :func:`loong_data.step_data.build_step_data`)."""

    tokenizer: Any  # a TextTokenizer, or a ChatTokenizer (data.kind=chat)
    train: PackedTextDataset | PackedDocuments | ChatTextDataset
    val: PackedTextDataset | PackedDocuments | ChatTextDataset
    layout: StepLayout

    def train_steps(self, start_step: int = 0, balancer: Balancer | None = None) -> Iterator[list[dict]]:
        lay = self.layout
        return step_batches(
            self.train, micro_batch_size=lay.micro_batch_size, num_microbatches=lay.num_microbatches,
            dp_rank=lay.dp_rank, dp_size=lay.dp_size, seed=lay.seed, start_step=start_step, balancer=balancer,
        )  # fmt: skip

    def eval_microbatches(self) -> list[dict]:
        """The same held-out micro-batches every time."""
        lay = self.layout
        return next(step_batches(self.val, micro_batch_size=lay.micro_batch_size, num_microbatches=lay.eval_iters,
                                 dp_rank=lay.dp_rank, dp_size=lay.dp_size, seed=lay.seed))  # fmt: skip

    def counts(self, microbatches: list[dict], loss_tokens: int) -> StepCounts:
        """Loss tokens: every token in fixed rows, the real ones in packed sequences; with one DP
        rank, the step's :func:`batch_digest` (a CRC of host tensors; over several ranks it would
        need a collective each step, so there it is None)."""
        digest = batch_digest(microbatches) if self.layout.dp_size == 1 else None
        return StepCounts(tokens=loss_tokens, digest=digest)


def _packed_documents(cfg: DataConfig, split: TokenFile, tokenizer: TextTokenizer, layout: StepLayout) -> PackedDocuments:
    t = cfg.thd
    lengths = LogNormalLengths(median=t.median_length, sigma=t.sigma, long_fraction=t.long_fraction)
    docs = DocumentDataset(split, cfg.seq_length, lengths=lengths, seed=layout.seed)
    return PackedDocuments(docs, cfg.seq_length, packing_strategy(t.strategy, t.buffer_size), tokenizer.pad_id,
                           layout.segment_multiple)  # fmt: skip


def load_text_data(cfg: DataConfig, layout: StepLayout, *, is_main: bool) -> TextStepData:
    """Tokenise once (main rank; cached across runs), then open the same files on every rank."""
    if cfg.kind == "chat":
        return _chat_data(cfg, layout)
    tokenizer = load_tokenizer(cfg.tokenizer or default_tokenizer())
    sources = [Path(s) for s in cfg.sources] or [default_corpus()]
    kwargs = dict(val_fraction=cfg.val_fraction, seed=layout.seed)
    if is_main:
        corpus = prepare_text_dataset(sources, tokenizer, Path(cfg.cache_dir), **kwargs)
    if dist.is_initialized():
        dist.barrier()
    if not is_main:
        corpus = prepare_text_dataset(sources, tokenizer, Path(cfg.cache_dir), **kwargs)  # cache hit
    if cfg.packing == "thd":
        return TextStepData(tokenizer, _packed_documents(cfg, corpus.train, tokenizer, layout),
                            _packed_documents(cfg, corpus.val, tokenizer, layout), layout)  # fmt: skip
    return TextStepData(tokenizer, PackedTextDataset(corpus.train, cfg.seq_length),
                        PackedTextDataset(corpus.val, cfg.seq_length), layout)  # fmt: skip


def _chat_data(cfg: DataConfig, layout: StepLayout) -> TextStepData:
    """Conversations through the chat template (every rank tokenises them: seconds for thousands)."""
    from loong_data.multimodal import load_chat_tokenizer

    tokenizer = load_chat_tokenizer(cfg.tokenizer)
    sources = cfg.sources or [default_chat_dataset()]
    split = dict(val_fraction=cfg.val_fraction)
    return TextStepData(tokenizer, ChatTextDataset(sources, tokenizer, cfg.seq_length, split="train", **split),
                        ChatTextDataset(sources, tokenizer, cfg.seq_length, split="val", **split), layout)  # fmt: skip
