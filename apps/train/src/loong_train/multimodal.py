"""The multimodal data path of the train app (``data.kind=multimodal``).

Sources become WebDataset shards once: JSONL conversations + media (default: loong-data's bundled
real images with captions and questions) are converted into ``data.cache_dir`` on first use, in a
seeded record order, so the held-out last shard(s) are a random sample of the data. A folder of
shards made by ``loong-data convert-to-webdataset`` is used as it is.

Each step takes the next ``train.global_batch_size`` samples of one seeded sample stream (the same
on every rank); DP rank ``r`` keeps the ``r``-th slice, packs it into ``data.seq_length``-token THD
micro-batches and preprocesses only its own images. So a DP=N run sees the global batches of the
single-process run, and resuming at step ``s`` skips exactly ``s * global_batch_size`` samples
(tokenised and their images decoded, not resized/patchified): the streaming position resumes
exactly. The price: every rank reads (and decodes) every sample; shard-level DP splitting
(``loong_data.multimodal.PackedMultimodalDataset(dp_rank=...)``) would avoid it but does not keep
the global batches of a different DP size.
"""

from __future__ import annotations

import hashlib
import json
import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist

from loong_data import packing_strategy
from loong_data.multimodal import (
    ChatTokenizer,
    ConvertError,
    MultimodalSample,
    PackedMultimodalDataset,
    VisionProcessorConfig,
    default_multimodal_dataset,
    list_shards,
    load_chat_tokenizer,
    write_webdataset,
)
from loong_models import ModelConfig
from loong_train.log import logger
from loong_train.schema import ConfigError, DataConfig

MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
CONVERTED_VERSION = 1  # bump when the conversion below changes what it writes


@dataclass
class MultimodalData:
    tokenizer: ChatTokenizer
    processor: VisionProcessorConfig
    train_shards: list[Path]
    val_shards: list[Path]
    seq_length: int
    seed: int
    shuffle_buffer: int
    strategy: str
    _eval: list[dict] | None = field(default=None, repr=False)

    def _dataset(self, shards: list[Path], shuffle_buffer: int) -> PackedMultimodalDataset:
        return PackedMultimodalDataset(shards, self.tokenizer, seq_len=self.seq_length, processor=self.processor,
                                       seed=self.seed, shuffle_buffer=max(1, shuffle_buffer))  # fmt: skip

    def _pack(self, ds: PackedMultimodalDataset, samples: list[MultimodalSample]) -> list[dict]:
        packs = packing_strategy(self.strategy).pack([len(s) for s in samples], self.seq_length)
        return [ds.collate([samples[i] for i in pack]) for pack in packs]

    def train_steps(self, *, global_batch_size: int, dp_rank: int, dp_size: int, start_step: int = 0
                    ) -> Iterator[list[dict]]:  # fmt: skip
        """For each step from ``start_step``: this DP rank's packed micro-batches."""
        ds = self._dataset(self.train_shards, self.shuffle_buffer)
        stream = _forever(ds)
        skip = start_step * global_batch_size
        if skip:
            logger.info("resuming the multimodal stream: skipping %d samples", skip)
            for _ in islice(stream, skip):
                pass
        per_rank = global_batch_size // dp_size
        while True:
            step = list(islice(stream, global_batch_size))
            yield self._pack(ds, step[dp_rank * per_rank : (dp_rank + 1) * per_rank])

    def eval_microbatches(self, *, num_samples: int, dp_rank: int, dp_size: int) -> list[dict]:
        """This rank's share of the first ``num_samples`` held-out samples (the same every time)."""
        if self._eval is None:
            ds = self._dataset(self.val_shards, 1)
            samples = list(islice(_forever(ds), num_samples))
            per_rank = num_samples // dp_size
            self._eval = self._pack(ds, samples[dp_rank * per_rank : (dp_rank + 1) * per_rank])
        return self._eval


def _forever(ds: PackedMultimodalDataset) -> Iterator[MultimodalSample]:
    epoch = 0
    while True:
        any_sample = False
        for sample in ds.samples(epoch):
            any_sample = True
            yield sample
        if not any_sample:
            raise ConfigError(f"no usable sample in the shards {', '.join(map(str, ds.shards))}")
        epoch += 1


def batch_digest(microbatches: list[dict]) -> int:
    """CRC-32 of the step's token ids and image / video grids: two stacks (or two runs) that
    report the same digest trained on the same samples (benchmarks assert it)."""
    crc = 0
    for mb in microbatches:
        for key in ("tokens", "image_grid_thw", "video_grid_thw"):
            if key in mb:
                crc = zlib.crc32(mb[key].to(torch.int64).numpy().tobytes(), crc)
    return crc


def step_counts(microbatches: list[dict], pad_id: int, group, device: torch.device) -> dict[str, int]:
    """Real tokens (padding excluded, image tokens included), images + videos and ViT patches of
    the step, summed over the data-parallel group (a collective), and ``digest``: the ranks'
    :func:`batch_digest` summed modulo 2**32."""
    tokens = images = patches = 0
    for mb in microbatches:
        cu, ids = mb["cu_seqlens"], mb["tokens"][0]
        tail = slice(int(cu[-2]), int(cu[-1]))
        padded = (
            len(cu) > 2 and bool((ids[tail] == pad_id).all()) and not bool(mb["loss_mask"][0, tail].any())
        )
        tokens += int(cu[-2]) if padded else int(ids.shape[0])
        for key in ("image_grid_thw", "video_grid_thw"):
            if key in mb and len(mb[key]):
                images += int(mb[key].shape[0])
                patches += int(mb[key].prod(dim=1).sum())
    t = torch.tensor([tokens, images, patches, batch_digest(microbatches)], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)  # float64 holds sums of up to 2**21 CRCs exactly
    counts = dict(zip(("tokens", "images", "patches", "digest"), (int(x) for x in t.tolist())))
    counts["digest"] %= 2**32
    return counts


# --- set-up: tokenizer and model agree, sources become shards ------------------------------------


def load_multimodal_tokenizer(cfg: DataConfig) -> ChatTokenizer:
    try:
        return load_chat_tokenizer(cfg.tokenizer)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"data.tokenizer={cfg.tokenizer!r}: {e}") from None


def check_model_and_tokenizer(model: ModelConfig, tokenizer: ChatTokenizer) -> None:
    """The model must have an image encoder and use the tokenizer's vision token ids."""
    if model.image_encoder is None:
        raise ConfigError("data.kind=multimodal (images in the data) but model.image_encoder is null: the model "
                          "cannot see images; choose a VLM, e.g. model=tiny-vlm")  # fmt: skip
    v = tokenizer.vision
    pairs = {"image_token_id": v.image_pad, "video_token_id": v.video_pad,
             "vision_start_token_id": v.vision_start, "vision_end_token_id": v.vision_end}  # fmt: skip
    for key, tok_id in pairs.items():
        model_id = getattr(model, key)
        if model_id is not None and model_id != tok_id:
            raise ConfigError(f"model.{key}={model_id} but the tokenizer ({tokenizer.path}) has id {tok_id} for "
                              f"that token; set model.{key}={tok_id}")  # fmt: skip
    if tokenizer.vocab_size > model.foundation.vocab_size:
        raise ConfigError(f"model.foundation.vocab_size={model.foundation.vocab_size} is smaller than the "
                          f"tokenizer's vocabulary ({tokenizer.vocab_size}, {tokenizer.path})")  # fmt: skip


def processor_config(cfg: DataConfig, model: ModelConfig) -> VisionProcessorConfig:
    """Patch and merge sizes come from the model's image encoder (one source of truth); pixel
    bounds from data.multimodal."""
    e, mm = model.image_encoder, cfg.multimodal
    return VisionProcessorConfig(patch_size=e.patch_size, temporal_patch_size=e.temporal_patch_size,
                                 merge_size=e.spatial_merge_size, min_pixels=mm.min_pixels,
                                 max_pixels=mm.max_pixels, video_min_pixels=mm.video_min_pixels,
                                 video_max_pixels=mm.video_max_pixels)  # fmt: skip


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def convert_sources(cfg: DataConfig, seed: int) -> Path:
    """Shards of the JSONL sources (bundled set when none) in ``data.cache_dir``, converted once:
    a fingerprint of the JSONL contents, media roots and conversion settings names the folder.
    Media files are not hashed: edit one in place and delete the folder to convert again."""
    mm = cfg.multimodal
    sources = [Path(p) for p in mm.jsonl] or [default_multimodal_dataset() / "conversations.jsonl"]
    for src in sources:
        if not src.is_file():
            raise ConfigError(f"data.multimodal.jsonl: {src} not found")
    roots = [Path(mm.media_root) if mm.media_root else src.parent for src in sources]
    key = {"version": CONVERTED_VERSION, "sources": [_sha256(s) for s in sources],
           "roots": [str(r.resolve()) for r in roots], "per_shard": mm.samples_per_shard, "seed": seed}  # fmt: skip
    fp = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(cfg.cache_dir) / f"multimodal-{fp}"
    if (out / "manifest.json").is_file():
        logger.info("multimodal shards: %s (cached)", out)
        return out
    # (the user's file:line, record, media root): a skipped record names the user's file and line
    records = []
    for src, root in zip(sources, roots):
        with src.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append((f"{src}:{n}", json.loads(line), root))
                    except json.JSONDecodeError as e:
                        raise ConfigError(
                            f"data.multimodal.jsonl: {src}:{n} is not valid JSON ({e.msg})"
                        ) from None
    random.Random(seed).shuffle(records)
    try:
        report = write_webdataset(records, out, inputs=sources, maxcount=mm.samples_per_shard, overwrite=True)
    except ConvertError as e:
        raise ConfigError(f"data.multimodal.jsonl: {e}") from None
    if report.num_skipped:
        logger.warning(
            "skipped %d bad records while converting, e.g. %s", report.num_skipped, report.errors[0]
        )
    logger.info("converted %d conversations into %d shards: %s", report.num_samples, len(report.shards), out)
    return out


def load_multimodal_data(cfg: DataConfig, model: ModelConfig, *, is_main: bool, seed: int) -> MultimodalData:
    """Tokenizer, processor and train / held-out shards (converting on the main rank first)."""
    tokenizer = load_multimodal_tokenizer(cfg)
    check_model_and_tokenizer(model, tokenizer)
    mm = cfg.multimodal
    if mm.shards:
        folder = Path(mm.shards)
    else:
        folder = convert_sources(cfg, seed) if is_main else None
        if dist.is_initialized():
            box = [str(folder) if folder else None]
            dist.broadcast_object_list(box, src=0)
            folder = Path(box[0])
    try:
        shards = list_shards(folder)
    except FileNotFoundError as e:
        raise ConfigError(f"data.multimodal.shards: {e}") from None
    if len(shards) <= mm.val_shards:
        raise ConfigError(f"data.multimodal.val_shards={mm.val_shards} leaves no training shard of the "
                          f"{len(shards)} in {folder} (lower data.multimodal.samples_per_shard)")  # fmt: skip
    return MultimodalData(tokenizer, processor_config(cfg, model), shards[: -mm.val_shards], shards[-mm.val_shards :],
                          cfg.seq_length, seed, mm.shuffle_buffer, cfg.thd.strategy)  # fmt: skip


def vision_flops_per_patch(model: ModelConfig) -> float:
    """Training FLOPs per ViT patch of the encoder and projector, 6 N per token (the projector runs
    on patches / merge**2 tokens); the ViT's attention is not counted (a few percent at 448 px)."""
    e = model.image_encoder
    proj = model.image_projector.num_parameters(
        e.hidden_size, e.spatial_merge_size, model.foundation.hidden_size
    )
    return 6 * e.num_parameters() + 6 * proj / e.spatial_merge_size**2


def encoder_process_groups(model: ModelConfig, foundation_tp: int):
    """The image encoder's process groups when its TP size (``model.image_encoder.
    tensor_model_parallel_size``) differs from the foundation's, else None (megatron's own).
    Collective when they differ."""
    from loong_models import encoder_tensor_parallel_size
    from loong_parallel.component_groups import component_process_groups

    if model.image_encoder is None:
        return None
    try:
        etp = encoder_tensor_parallel_size(model, foundation_tp)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return component_process_groups(etp) if etp != foundation_tp else None
