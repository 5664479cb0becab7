"""``data.kind=lerobot``: a LeRobot dataset's frames as Pi0.5 micro-batches (loong_data.lerobot).

Training samples are the frames of all but the last ``val_episodes`` episodes, in a seeded
permutation cut per step and DP rank (DP=N sees the samples of DP=1; resume starts at the step);
each sample carries its ``sample_ids`` (its place in the run's sample stream), from which the
policy draws its flow noise and time, so that a sample's draw does not depend on the layout.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from loong_data.bundled import default_robot_dataset, default_tokenizer
from loong_data.lerobot import LeRobotDataset, Pi05BatchConfig, Pi05Batcher
from loong_data.prefetch import pinned, prefetch
from loong_data.sampler import DistributedBatchSampler
from loong_data.step_data.config import DataConfig
from loong_data.step_data.layout import DataError, StepCounts, StepLayout


def lerobot_digest(microbatches: list[dict]) -> int:
    """CRC-32 of the step's prompt tokens, actions and sample ids: two stacks (or two runs) that
    report the same digest trained on the same samples (the Pi0.5 benchmark asserts it)."""
    crc = 0
    for mb in microbatches:
        for key in ("tokens", "actions", "sample_ids"):
            if key in mb:
                crc = zlib.crc32(mb[key].contiguous().numpy().tobytes(), crc)
    return crc


@dataclass
class LeRobotStepData:
    batcher: Pi05Batcher
    train_frames: np.ndarray
    val_frames: np.ndarray
    layout: StepLayout

    @property
    def tokenizer(self):
        return self.batcher.tokenizer

    def _collate(self, frames: list[int], ids: list[int]) -> dict[str, torch.Tensor]:
        batch = self.batcher.collate(frames)
        batch["sample_ids"] = torch.tensor(ids, dtype=torch.long)
        return batch

    def train_steps(self, start_step: int = 0, balancer=None) -> Iterator[list[dict]]:
        """This DP rank's micro-batches for each step from ``start_step``, prepared one step ahead
        in a background thread (frames decoded and resized, prompts tokenised while the device
        trains), in page-locked memory for a CUDA device."""
        if balancer is not None:
            raise DataError(
                "parallel.balance does not apply to data.kind=lerobot (every sample costs the same)"
            )
        return prefetch(pinned(self._steps(start_step), self.layout.device))

    def _steps(self, start_step: int) -> Iterator[list[dict]]:
        lay = self.layout
        sampler = DistributedBatchSampler(len(self.train_frames), micro_batch_size=lay.micro_batch_size,
                                          num_microbatches=lay.num_microbatches, dp_rank=lay.dp_rank,
                                          dp_size=lay.dp_size, seed=lay.seed, start_step=start_step)  # fmt: skip
        per_rank = lay.micro_batch_size * lay.num_microbatches
        for step, micro in enumerate(sampler, start=start_step):
            first = (
                step * sampler.global_batch_size + lay.dp_rank * per_rank
            )  # this rank's place in the stream
            ids = (lay.seed << 40) + first + np.arange(per_rank)
            yield [self._collate([int(self.train_frames[i]) for i in idx],
                                 ids[k * lay.micro_batch_size : (k + 1) * lay.micro_batch_size].tolist())
                   for k, idx in enumerate(micro)]  # fmt: skip

    def eval_microbatches(self) -> list[dict]:
        """``eval_iters`` micro-batches of held-out frames, this rank's share, fixed noise ids."""
        lay, mbs = self.layout, self.layout.micro_batch_size
        frames = self.val_frames[
            np.linspace(0, len(self.val_frames) - 1, lay.eval_iters * mbs * lay.dp_size).astype(int)
        ]
        mine = frames.reshape(lay.dp_size, -1)[lay.dp_rank]
        base = (1 << 62) + lay.dp_rank * len(mine)
        return [self._collate(mine[k * mbs : (k + 1) * mbs].tolist(), list(range(base + k * mbs, base + (k + 1) * mbs)))
                for k in range(lay.eval_iters)]  # fmt: skip

    def counts(self, microbatches: list[dict], loss_tokens: int) -> StepCounts:
        """Tokens: the prompt tokens and action steps the policy processed; images: camera frames."""
        tokens = sum(
            int(b["token_mask"].sum()) + b["actions"].shape[0] * b["actions"].shape[1] for b in microbatches
        )
        images = sum(int(b["image_masks"].sum()) for b in microbatches)
        samples = sum(int(b["actions"].shape[0]) for b in microbatches)
        totals = [tokens, images, samples, lerobot_digest(microbatches)]
        if self.layout.dp_group is not None and self.layout.dp_size > 1:
            # summed over the DP ranks; reading the sum back waits for the device. One rank's counts
            # stay on the host: a read-back there would wait for the step's optimizer update
            reduced = torch.tensor(totals, device=self.layout.device)
            torch.distributed.all_reduce(reduced, group=self.layout.dp_group)
            totals = reduced.tolist()
        return StepCounts(tokens=int(totals[0]), images=int(totals[1]), samples=int(totals[2]),
                          digest=int(totals[3]) % 2**32)  # fmt: skip


def load_lerobot_data(cfg: DataConfig, layout: StepLayout) -> LeRobotStepData:
    c = cfg.lerobot
    ds = LeRobotDataset(c.root or default_robot_dataset(), horizon=c.horizon)
    episodes = [e.index for e in ds.meta.episodes]
    if len(episodes) <= c.val_episodes:
        raise DataError(f"{ds.meta.root}: {len(episodes)} episodes, data.lerobot.val_episodes={c.val_episodes} "
                        "leaves none to train on")  # fmt: skip
    held_out = np.isin(ds.columns["episode_index"], episodes[-c.val_episodes :])
    tokenizer = cfg.tokenizer or default_tokenizer()
    batcher = Pi05Batcher(ds, tokenizer, Pi05BatchConfig(c.image_size, c.max_state_dim, c.max_action_dim, c.max_length,
                                                         norm_mode=c.norm_mode))  # fmt: skip
    return LeRobotStepData(batcher, np.flatnonzero(~held_out), np.flatnonzero(held_out), layout)
