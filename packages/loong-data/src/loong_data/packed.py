"""Fixed-length language-model samples packed from a continuous token stream."""

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from loong_data.errors import DataError
from loong_data.token_file import TokenFile, too_short


class PackedTextDataset(Dataset[dict[str, torch.Tensor]]):
    """Sample ``i`` is ``tokens[i*seq_length : i*seq_length + seq_length + 1]`` of the token file.

    Documents already end with EOD, so packing across document boundaries needs no separator.
    Consecutive samples share one token: the last label of sample ``i`` is the first input of
    ``i + 1``, so every token is predicted once. Each item is a dict of ``seq_length`` tensors:
    ``tokens`` and ``labels`` (tokens shifted by one) as int64, ``loss_mask`` float32 ones,
    ``position_ids`` ``0..seq_length-1``.
    """

    def __init__(self, token_file: TokenFile | str | Path, seq_length: int) -> None:
        self.token_file = token_file if isinstance(token_file, TokenFile) else TokenFile(token_file)
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.seq_length = seq_length
        # The +1 is the label of the last position.
        self._num_samples = (self.token_file.num_tokens - 1) // seq_length
        if self._num_samples < 1:
            raise DataError(too_short(self.token_file, f"one sample of seq_length {seq_length} needs {seq_length + 1}"))
        self._position_ids = torch.arange(seq_length, dtype=torch.long)
        self._loss_mask = torch.ones(seq_length, dtype=torch.float32)

    def __len__(self) -> int:
        return self._num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -self._num_samples <= index < self._num_samples:
            raise IndexError(f"sample {index} out of range for {self._num_samples} samples")
        start = (index % self._num_samples) * self.seq_length
        window = torch.from_numpy(np.asarray(self.token_file.tokens[start : start + self.seq_length + 1], dtype=np.int64))
        return {
            "tokens": window[:-1],
            "labels": window[1:],
            # Clones: collate stacks into new storage anyway, but callers may modify a sample.
            "loss_mask": self._loss_mask.clone(),
            "position_ids": self._position_ids.clone(),
        }
