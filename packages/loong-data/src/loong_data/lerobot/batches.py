"""LeRobot frames -> Pi0.5 training batches, sharded over data-parallel ranks and resumable.

A batch is what ``loong_models.embodied.Pi05Policy`` takes: ``images`` [B, cameras, 3, S, S] in
[-1, 1] (resized to the model's image size), ``image_masks``, the prompt ``tokens`` /
``token_mask`` (task + the normalised state discretised into bins, right-padded), ``actions``
[B, H, max_action_dim] normalised and zero-padded, and ``action_dim_mask`` (the real dims).
States and actions are normalised with the dataset's stats (quantiles by default, as Pi0.5).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from loong_data.lerobot.dataset import LeRobotDataset
from loong_data.lerobot.prompt import state_prompt
from loong_data.lerobot.stats import Normalizer
from loong_data.sampler import DistributedBatchSampler
from loong_data.tokenizer import load_tokenizer


@dataclass
class Pi05BatchConfig:
    image_size: int
    max_state_dim: int
    max_action_dim: int
    max_length: int  # prompt tokens
    state_bins: int = 256
    norm_mode: str = "quantiles"


class Pi05Batcher:
    """Turns frames of ``dataset`` into batches; :meth:`policy_inputs` does the same for one live
    observation (rollouts), :meth:`unnormalise_actions` maps predictions back to the robot."""

    def __init__(self, dataset: LeRobotDataset, tokenizer: str | Path, cfg: Pi05BatchConfig) -> None:
        self.ds, self.cfg = dataset, cfg
        self.tokenizer = load_tokenizer(tokenizer)
        stats = dataset.meta.stats
        self.state_norm = Normalizer(stats[dataset.state_key], cfg.norm_mode, dataset.state_key)
        self.action_norm = Normalizer(stats[dataset.action_key], cfg.norm_mode, dataset.action_key)
        self.state_dim = dataset.meta.features[dataset.state_key]["shape"][0]
        self.action_dim = dataset.meta.features[dataset.action_key]["shape"][0]
        for name, dim, cap in (
            ("state", self.state_dim, cfg.max_state_dim),
            ("action", self.action_dim, cfg.max_action_dim),
        ):
            if dim > cap:
                raise ValueError(
                    f"{dataset.meta.root}: {name} has {dim} dims, more than the model's max_{name}_dim={cap}"
                )

    def _tokens(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.cfg.max_length
        tokens = torch.full((len(prompts), n), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), n, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids = self.tokenizer.encode(p)[:n]  # a prompt longer than max_length is cut, as LeRobot's
            tokens[i, : len(ids)], mask[i, : len(ids)] = torch.tensor(ids), True
        return tokens, mask

    def _images(self, frames: list[dict[str, np.ndarray]]) -> torch.Tensor:
        """uint8 HWC per camera -> [B, cameras, 3, S, S] in [-1, 1]."""
        x = torch.stack(
            [torch.stack([torch.as_tensor(np.array(f[k])) for k in self.ds.camera_keys]) for f in frames]
        )
        b, c, h, w, _ = x.shape
        x = x.reshape(b * c, h, w, 3).permute(0, 3, 1, 2).float() / 255.0
        if (h, w) != (self.cfg.image_size,) * 2:
            x = F.interpolate(x, size=(self.cfg.image_size,) * 2, mode="bilinear", align_corners=False)
        return (x * 2 - 1).reshape(b, c, 3, self.cfg.image_size, self.cfg.image_size)

    def _pad(self, x: np.ndarray, width: int) -> torch.Tensor:
        return F.pad(torch.from_numpy(x), (0, width - x.shape[-1]))

    def policy_inputs(
        self, states: np.ndarray, images: list[dict[str, np.ndarray]], tasks: list[str]
    ) -> dict:
        """The prefix inputs (no actions) for raw states [B, state_dim] and camera frames."""
        norm = np.clip(self.state_norm(states), -1, 1)
        tokens, mask = self._tokens([state_prompt(t, s, self.cfg.state_bins) for t, s in zip(tasks, norm)])
        return {"images": self._images(images), "image_masks": torch.ones(len(tasks), len(self.ds.camera_keys), dtype=torch.bool),
                "tokens": tokens, "token_mask": mask}  # fmt: skip

    def collate(self, indices: list[int]) -> dict[str, torch.Tensor]:
        frames = [self.ds[i] for i in indices]
        batch = self.policy_inputs(np.stack([f["state"] for f in frames]), [f["images"] for f in frames],
                                   [f["task"] for f in frames])  # fmt: skip
        actions = self.action_norm(np.stack([f["actions"] for f in frames]))
        batch["actions"] = self._pad(actions, self.cfg.max_action_dim)
        batch["action_dim_mask"] = torch.arange(self.cfg.max_action_dim) < self.action_dim
        return batch

    def unnormalise_actions(self, actions: torch.Tensor) -> np.ndarray:
        return self.action_norm.inverse(actions[..., : self.action_dim].float().cpu().numpy())


def rank_batches(batcher: Pi05Batcher, *, micro_batch_size: int, num_microbatches: int, dp_rank: int, dp_size: int,
                 seed: int, start_step: int = 0) -> Iterator[list[dict[str, torch.Tensor]]]:  # fmt: skip
    """Per step, this rank's micro-batches: a seeded permutation of all frames, each global batch
    cut into DP slices (DP=N sees the samples of DP=1), starting at ``start_step`` (resume)."""
    sampler = DistributedBatchSampler(len(batcher.ds), micro_batch_size=micro_batch_size,
                                      num_microbatches=num_microbatches, dp_rank=dp_rank, dp_size=dp_size,
                                      seed=seed, start_step=start_step)  # fmt: skip
    for micro in sampler:
        yield [batcher.collate(idx) for idx in micro]
