"""Prepared diffusion shards in memory, and the deterministic batches a step draws from them.

Samples are grouped into buckets of one latent shape (1-frame images, clips). Step ``s`` draws
its global batch from one bucket (chosen with probability proportional to its size) with a
generator seeded by (seed, s); each draw gets a unique sample id ``s * global_batch + position``
that seeds its noise, so a resumed run sees exactly the same batches and noise.
"""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loong_data.diffusion.prepare import META


@dataclass
class LatentSamples:
    latents: list[torch.Tensor]
    contexts: list[torch.Tensor]
    captions: list[str]
    ids: list[str]
    meta: dict
    buckets: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, z in enumerate(self.latents):
            self.buckets.setdefault(tuple(z.shape), []).append(i)

    def __len__(self) -> int:
        return len(self.latents)

    def step_batch(self, step: int, global_batch: int, seed: int) -> tuple[list[int], list[int]]:
        """(sample indices, noise sample ids) of the global batch of ``step``."""
        g = torch.Generator().manual_seed(seed * 7919 + step)
        keys = sorted(self.buckets)
        sizes = torch.tensor([len(self.buckets[k]) for k in keys], dtype=torch.float64)
        bucket = self.buckets[keys[int(torch.multinomial(sizes, 1, generator=g))]]
        if len(bucket) >= global_batch:
            pick = torch.randperm(len(bucket), generator=g)[:global_batch]
        else:
            pick = torch.randint(len(bucket), (global_batch,), generator=g)
        return [bucket[int(i)] for i in pick], [step * global_batch + j for j in range(global_batch)]

    def collate(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([self.latents[i] for i in indices]), torch.stack([self.contexts[i] for i in indices])


def load_latent_samples(path: str | Path) -> LatentSamples:
    """Every sample of a prepared shard directory (small sets: held in memory)."""
    path = Path(path)
    if not (path / META).is_file():
        raise FileNotFoundError(f"{path}: no {META}; run loong-data diffusion-prepare first")
    meta = json.loads((path / META).read_text())
    rows: dict[str, dict] = {}
    for shard in meta["shards"]:
        with tarfile.open(path / shard) as tar:
            for m in tar.getmembers():
                key, _, ext = m.name.partition(".")
                data = tar.extractfile(m).read()
                rows.setdefault(key, {})[ext] = data
    out = LatentSamples([], [], [], [], meta)
    for key, r in rows.items():
        if not {"latents.pth", "context.pth", "json"} <= set(r):
            raise ValueError(f"{path}: sample {key} lacks latents.pth / context.pth / json")
        out.latents.append(torch.load(io.BytesIO(r["latents.pth"]), weights_only=True))
        out.contexts.append(torch.load(io.BytesIO(r["context.pth"]), weights_only=True))
        info = json.loads(r["json"])
        out.captions.append(info["caption"])
        out.ids.append(info["id"])
    out.__post_init__()
    return out
