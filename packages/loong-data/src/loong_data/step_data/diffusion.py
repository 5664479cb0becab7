"""``data.kind=diffusion``: prepared latents + text embeddings (``loong-data diffusion-prepare``,
run on the main rank on first use and cached under ``data.cache_dir``) as micro-batches
``{latents [b, C, F, H, W], context [b, text_len, d], sample_ids [b]}``.

Each step's global batch is one latent shape (images, or clips), drawn from (seed, step) only
(:meth:`loong_data.diffusion.LatentSamples.step_batch`); DP rank r takes its contiguous share.
``sample_ids`` seed each sample's noise in the model's objective, so resume reproduces the losses.
Evaluation: a fixed batch of the set with fixed noise ids (the set is too small to hold out).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loong_data.step_data.layout import DataError, StepCounts, StepLayout

EVAL_IDS = 10**12  # noise ids of the evaluation batch, apart from any training step's


@dataclass
class DiffusionDataConfig:
    shards: str | None = None  # a prepared folder (diffusion-prepare); null: prepare into data.cache_dir
    jsonl: str | None = None  # captioned media ({"media", "caption"} per line); null: the bundled set
    clips: bool = True  # the bundled set's short clips besides its images
    size: int = 32  # frame side in pixels
    text_len: int = 32  # text tokens (the model's diffusion.text_len)
    vae: dict[str, Any] = field(default_factory=dict)  # AutoencoderKLWan kwargs (the model's vae)
    text_encoder: dict[str, Any] = field(default_factory=dict)  # UMT5Config fields (the model's text_encoder)
    vae_dir: str | None = None  # pretrained towers instead of seeded random ones
    text_encoder_dir: str | None = None
    tower_seed: int = 0

    def errors(self) -> list[str]:
        errors = []
        if self.shards and self.jsonl:
            errors.append("data.diffusion.shards and data.diffusion.jsonl are exclusive")
        if self.size < 8 or self.text_len < 1:
            errors.append(f"data.diffusion.size={self.size} must be >= 8 and text_len={self.text_len} >= 1")
        return errors


@dataclass(frozen=True)
class DiffusionTokenizer:
    path: str
    vocab_size: int
    pad_id: int = 0


@dataclass
class DiffusionStepData:
    samples: Any  # loong_data.diffusion.LatentSamples
    layout: StepLayout
    tokenizer: DiffusionTokenizer
    tokens_per_frame_patch: int  # latent elements (per channel) per model token

    def _microbatches(self, indices: list[int], ids: list[int]) -> list[dict]:
        lay = self.layout
        share = len(indices) // lay.dp_size
        lo = lay.dp_rank * share
        out = []
        for j in range(lo, lo + share, lay.micro_batch_size):
            part = slice(j, j + lay.micro_batch_size)
            latents, context = self.samples.collate(indices[part])
            out.append({"latents": latents, "context": context, "sample_ids": torch.tensor(ids[part])})
        return out

    def train_steps(self, start_step: int = 0, balancer=None) -> Iterator[list[dict]]:
        if balancer is not None:
            raise DataError("parallel.balance is not supported with data.kind=diffusion")
        step = start_step
        while True:
            step += 1
            yield self._microbatches(*self.samples.step_batch(step, self.layout.global_batch_size, self.layout.seed))

    def eval_microbatches(self) -> list[dict]:
        lay = self.layout
        n = lay.eval_iters * lay.micro_batch_size * lay.dp_size
        indices, _ = self.samples.step_batch(0, n, lay.seed + 1)
        return self._microbatches(indices, [EVAL_IDS + j for j in range(n)])

    def counts(self, microbatches: list[dict], loss_tokens: int) -> StepCounts:
        """Latent tokens of the step, over every DP rank (each holds an equal share of one shape)."""
        local = sum(mb["latents"][:, 0].numel() for mb in microbatches) // self.tokens_per_frame_patch
        samples = sum(len(mb["sample_ids"]) for mb in microbatches)
        return StepCounts(tokens=local * self.layout.dp_size, images=samples * self.layout.dp_size)


def _plain(node: Any) -> dict[str, Any]:
    return dataclasses.asdict(node) if dataclasses.is_dataclass(node) else dict(node)


def _prepare(cfg, layout: StepLayout, is_main: bool) -> Path:
    from loong_data.diffusion import bundled_captioned_media, prepare_diffusion_shards
    from loong_data.diffusion.media import jsonl_captioned_media

    d = cfg.diffusion
    if d.shards:
        return Path(d.shards)
    folder = None
    if is_main:
        items = jsonl_captioned_media(Path(d.jsonl)) if d.jsonl else bundled_captioned_media(clips=d.clips)
        vae, text = _plain(d.vae), _plain(d.text_encoder)  # the model's configs, by interpolation
        tok = cfg.tokenizer or text.pop("tokenizer", None)
        name = f"diffusion-{Path(d.jsonl).stem if d.jsonl else 'bundled'}-{d.size}px"
        folder = prepare_diffusion_shards(items, Path(cfg.cache_dir) / name, vae=vae, text_encoder=text,
                                          text_len=d.text_len, size=d.size, seed=d.tower_seed, tokenizer=tok,
                                          vae_dir=d.vae_dir, text_dir=d.text_encoder_dir).out_dir  # fmt: skip
    if dist.is_initialized():
        box = [str(folder) if folder else None]
        dist.broadcast_object_list(box, src=0)
        folder = Path(box[0])
    return folder


def load_diffusion_data(cfg, layout: StepLayout, *, is_main: bool, patches) -> DiffusionStepData:
    """The prepared set (preparing it on the main rank first). ``patches``: the DiT's latent patch."""
    from loong_data.diffusion import load_latent_samples

    if patches is None:
        raise DataError("data.kind=diffusion needs a diffusion model (model.diffusion), e.g. model=wan-tiny")
    if layout.global_batch_size % (layout.dp_size * layout.micro_batch_size):
        raise DataError("train.global_batch_size must be a multiple of micro_batch_size x DP size")
    folder = _prepare(cfg, layout, is_main)
    samples = load_latent_samples(folder)
    if samples.meta["text_len"] != cfg.diffusion.text_len:
        raise DataError(f"{folder}: prepared with text_len={samples.meta['text_len']}, data.diffusion.text_len="
                        f"{cfg.diffusion.text_len}")  # fmt: skip
    tok_dir = folder / "towers" / "tokenizer"
    from transformers import AutoTokenizer

    tokenizer = DiffusionTokenizer(str(tok_dir), len(AutoTokenizer.from_pretrained(tok_dir)))
    per_token = patches.temporal_patch_size * patches.patch_size**2
    return DiffusionStepData(samples, layout, tokenizer, per_token)
