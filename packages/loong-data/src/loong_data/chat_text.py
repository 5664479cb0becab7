"""Text-only chat conversations (JSONL, ``{"messages": [...]}`` per line) as fixed-length SFT samples.

Each conversation goes through a :class:`~loong_data.multimodal.ChatTokenizer` (chat template,
assistant mask) and becomes one ``seq_length`` sample: ``tokens``, ``labels`` (next token),
``loss_mask`` (1 only where the label is a token the assistant says, its closing end-of-turn
included), ``position_ids``. Longer conversations are cut at ``seq_length``; shorter ones are
padded with the pad id, masked out. A deterministic ``val_fraction`` of conversations is held out.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch

from loong_data.errors import DataError
from loong_data.multimodal.chat import ChatTokenizer, ConversationError


class ChatDataError(DataError):
    """A chat file or record that cannot be used; the message names the file and line."""


def _records(paths: Sequence[Path]) -> list[tuple[str, list[dict]]]:
    out = []
    for path in paths:
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise FileNotFoundError(f"chat data {path}: no .jsonl file")
        for f in files:
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    messages = json.loads(line)["messages"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ChatDataError(f"{f}:{n}: expected a JSON object with 'messages' ({e})") from None
                out.append((f"{f}:{n}", messages))
    return out


class ChatTextDataset:
    """Fixed-length SFT samples of one split (``train`` or ``val``) of the conversations in ``paths``."""

    def __init__(self, paths: Sequence[str | Path], tokenizer: ChatTokenizer, seq_length: int, *,
                 split: str = "train", val_fraction: float = 0.02) -> None:  # fmt: skip
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}; allowed: train, val")
        self.seq_length, self.pad_id = seq_length, tokenizer.pad_id
        self.samples: list[tuple[torch.Tensor, torch.Tensor]] = []
        for where, messages in _records([Path(p) for p in paths]):
            # held out by a hash of the record's text: stable whatever the file order
            held_out = zlib.crc32(json.dumps(messages, sort_keys=True).encode()) % 10_000 < val_fraction * 10_000
            if held_out != (split == "val"):
                continue
            try:
                ids, mask = tokenizer.encode(messages)
            except ConversationError as e:  # also: images in a text-only set (no media counts given)
                raise ChatDataError(f"{where}: {e}") from None
            ids, mask = ids[: seq_length + 1], mask[: seq_length + 1]
            if sum(mask[1:]) == 0:
                continue  # nothing the assistant says fits: no loss to learn from
            self.samples.append((torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.float32)))
        if not self.samples:
            raise ChatDataError(f"{', '.join(map(str, paths))}: no {split} conversation with an assistant turn")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, mask = self.samples[index]
        n = len(ids) - 1
        tokens = torch.full((self.seq_length,), self.pad_id, dtype=torch.long)
        labels = torch.full((self.seq_length,), self.pad_id, dtype=torch.long)
        loss_mask = torch.zeros(self.seq_length, dtype=torch.float32)
        tokens[:n], labels[:n], loss_mask[:n] = ids[:-1], ids[1:], mask[1:]
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                "position_ids": torch.arange(self.seq_length)}  # fmt: skip
