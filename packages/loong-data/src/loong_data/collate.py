"""Stack samples into a batch."""

from collections.abc import Mapping, Sequence

import torch


def collate(samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of sample dicts (same keys, same shapes) into one dict of ``[batch, ...]`` tensors."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    keys = samples[0].keys()
    for i, sample in enumerate(samples):
        if sample.keys() != keys:
            raise ValueError(f"sample {i} has keys {sorted(sample)}, expected {sorted(keys)}")
    return {key: torch.stack([sample[key] for sample in samples]) for key in keys}
