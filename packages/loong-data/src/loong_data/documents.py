"""Variable-length language-model samples that never cross a document boundary."""

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from loong_data.errors import DataError
from loong_data.lengths import LogNormalLengths
from loong_data.token_file import TokenFile, too_short


def _chunk_starts(num_inputs: int, max_length: int, lengths: LogNormalLengths | None,
                  rng: np.random.Generator) -> np.ndarray:
    """Start offsets (relative to the document) of chunks covering ``num_inputs`` input positions."""
    if lengths is None:
        return np.arange(0, num_inputs, max_length, dtype=np.int64)
    # Draw enough lengths at once (each is >= the clipped minimum), then cut at the document end.
    shortest = min(lengths.min_length, max_length)
    drawn = lengths.sample(rng, num_inputs // shortest + 1, max_length)
    ends = np.cumsum(drawn)
    count = int(np.searchsorted(ends, num_inputs)) + 1
    return np.concatenate([[0], ends[: count - 1]]).astype(np.int64)


class DocumentDataset(Dataset[dict[str, torch.Tensor]]):
    """Samples cut from the documents of a token file, each inside one document.

    A document of ``n`` tokens (the last is EOD) has ``n - 1`` (input, label) pairs. They are cut
    into consecutive chunks of at most ``max_length`` pairs: with ``lengths=None`` only at
    ``max_length`` (whole documents when they fit), else at lengths drawn from ``lengths`` with a
    generator seeded by ``seed`` (the last chunk of a document takes the remainder). Each pair is
    in exactly one sample, so training on all samples is training on the documents.

    Sample ``i`` holds ``tokens`` and ``labels`` (int64, shifted by one), ``loss_mask`` (float32
    ones) and ``position_ids`` (``0..L-1``: positions restart in every sample), all of length
    ``L = lengths[i]``. :attr:`lengths` is known without reading tokens (for packing and balancing).
    """

    def __init__(self, token_file: TokenFile | str | Path, max_length: int, *,
                 lengths: LogNormalLengths | None = None, seed: int = 0) -> None:
        self.token_file = token_file if isinstance(token_file, TokenFile) else TokenFile(token_file)
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.max_length = max_length
        rng = np.random.default_rng(seed)
        starts, ends = [], []
        offsets = self.token_file.doc_offsets
        for d in range(self.token_file.num_docs):
            doc_start, num_inputs = int(offsets[d]), int(offsets[d + 1] - offsets[d]) - 1
            if num_inputs < 1:  # an empty document is just its EOD: nothing to predict
                continue
            rel = _chunk_starts(num_inputs, max_length, lengths, rng)
            starts.append(doc_start + rel)
            ends.append(doc_start + np.append(rel[1:], num_inputs))
        if not starts:
            raise DataError(too_short(self.token_file, "a sample needs a document of at least two tokens"))
        self.starts = np.concatenate(starts)
        self.lengths = np.concatenate(ends) - self.starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        start, length = int(self.starts[index]), int(self.lengths[index])
        window = torch.from_numpy(np.asarray(self.token_file.tokens[start : start + length + 1], dtype=np.int64))
        return {
            "tokens": window[:-1],
            "labels": window[1:],
            "loss_mask": torch.ones(length, dtype=torch.float32),
            "position_ids": torch.arange(length, dtype=torch.long),
        }
