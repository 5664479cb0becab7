"""Streaming multimodal SFT data: WebDataset shards -> packed THD micro-batches with vision patches.

Per epoch ``e`` (all seeded by ``seed + e``, so every run and every rank agrees):

1. shards in a seeded order; with at least ``dp_size`` shards, rank ``r`` reads shards
   ``r, r + dp_size, ...`` of that order, else every rank reads all shards and keeps samples
   ``i % dp_size == r`` (disjoint either way);
2. a seeded shuffle buffer mixes samples across shards;
3. each sample is decoded (images and video frames fully decoded, so a corrupt file fails here,
   named by shard and key), rendered by the chat template, its media placeholders expanded to the
   media's token counts and its loss mask set on assistant tokens; too long samples follow
   ``overflow``;
4. ``pack_buffer`` samples at a time are packed (first-fit decreasing by default) into sequences
   of at most ``seq_length`` tokens; pixels are resized and patchified only for packs that are
   yielded, so skipping packs to resume (``start_pack``) reads and tokenises but does not
   preprocess images.

The stream is infinite (epoch after epoch): ranks that read different amounts of data still take
the same number of micro-batches per step.
"""

import glob
import io
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from loong_data.errors import DataError
from loong_data.log import logger
from loong_data.multimodal.chat import ChatTokenizer, ConversationError, _check_messages, load_chat_tokenizer
from loong_data.multimodal.convert import MANIFEST
from loong_data.multimodal.processor import VisionProcessorConfig, process_image, process_video
from loong_data.packed_collate import collate_packed
from loong_data.packing import packing_strategy

ON_ERROR = ("raise", "skip")
OVERFLOW = ("truncate", "skip", "error")


class MultimodalDataError(DataError):
    """A sample or shard that cannot be used; the message names the shard and the sample key."""


@dataclass
class MultimodalSample:
    """One tokenised conversation with its decoded media (pixels not yet preprocessed).

    ``tokens`` / ``labels`` / ``loss_mask`` are 1-D (labels = next tokens, loss on assistant
    targets only); ``media`` are ``("image", [frame])`` or ``("video", frames)`` in order of
    appearance, ``grids`` their ``(t, h, w)`` patch grids.
    """

    key: str
    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    media: list[tuple[str, list[Image.Image]]] = field(default_factory=list)
    grids: list[tuple[int, int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def list_shards(source: str | Path | Sequence[str | Path]) -> list[Path]:
    """Tar shards of a folder (in ``manifest.json`` order when there is one, else sorted), one
    ``.tar`` file, a glob pattern, or a list of files."""
    if isinstance(source, (list, tuple)):
        shards = [Path(s) for s in source]
    else:
        path = Path(source)
        if path.is_dir():
            manifest = path / MANIFEST
            if manifest.is_file():
                shards = [
                    path / s["name"] for s in json.loads(manifest.read_text(encoding="utf-8"))["shards"]
                ]
            else:
                shards = sorted(path.glob("*.tar"))
        elif path.is_file():
            shards = [path]
        else:
            shards = [Path(p) for p in sorted(glob.glob(str(source)))]
    missing = [s for s in shards if not s.is_file()]
    if missing:
        raise FileNotFoundError(f"shard not found: {missing[0]}")
    if not shards:
        raise FileNotFoundError(f"no .tar shards in {source}")
    return shards


def _tar_samples(shard: Path) -> Iterator[dict]:
    import webdataset as wds

    dataset = wds.WebDataset(
        str(shard), shardshuffle=False, nodesplitter=None, workersplitter=None, empty_check=False
    )
    yield from dataset


def _decode_media(raw: dict, name: object) -> Image.Image:
    if not isinstance(name, str):
        raise MultimodalDataError(f"a media reference must be a member name, got {name!r}")
    if name not in raw:
        raise MultimodalDataError(f"no file {name!r} in the sample")
    try:
        image = Image.open(io.BytesIO(raw[name]))
        image.load()
        return image.convert("RGB")
    except Exception as e:
        raise MultimodalDataError(f"cannot decode {name!r}: {e}") from e


def _media_of(raw: dict, messages: list[dict]) -> list[tuple[str, list[Image.Image]]]:
    media = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for item in content:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "image":
                media.append(("image", [_decode_media(raw, item["image"])]))
            elif item.get("type") == "video":
                frames = item["video"] if isinstance(item["video"], list) else [item["video"]]
                media.append(("video", [_decode_media(raw, f) for f in frames]))
    return media


def encode_sample(
    raw: dict,
    tokenizer: ChatTokenizer,
    config: VisionProcessorConfig,
    *,
    seq_length: int,
    overflow: str = "truncate",
) -> MultimodalSample | None:
    """A :class:`MultimodalSample` of one raw WebDataset sample (``__key__``, ``__url__``, ``json``,
    media files), or None when ``overflow="skip"`` drops it. Raises :class:`MultimodalDataError`
    naming the shard and key."""
    key = f"{raw.get('__url__', '?')}#{raw.get('__key__', '?')}"
    try:
        if "json" not in raw:
            raise MultimodalDataError("no 'json' member")
        try:
            record = json.loads(raw["json"])
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise MultimodalDataError(f"'json' member is not JSON: {e}") from e
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list):
            raise MultimodalDataError("'json' has no 'messages' list")
        _check_messages(messages)
        media = _media_of(raw, messages)
        grids = [
            config.image_grid(frames[0].height, frames[0].width)
            if kind == "image"
            else config.video_grid(len(frames), frames[0].height, frames[0].width)
            for kind, frames in media
        ]
        ids, mask = tokenizer.encode(messages, [config.num_tokens(g) for g in grids])
    except (MultimodalDataError, ConversationError, ValueError) as e:
        raise MultimodalDataError(f"sample {key}: {e}") from e
    if len(ids) - 1 > seq_length:
        if overflow == "error":
            raise MultimodalDataError(
                f"sample {key}: {len(ids) - 1} tokens, more than seq_length {seq_length} "
                "(overflow='truncate' or 'skip' to go on)"
            )
        if overflow == "skip":
            logger.warning("skipped sample %s: %d tokens > seq_length %d", key, len(ids) - 1, seq_length)
            return None
        ids, mask, kept = _truncate(ids, mask, seq_length + 1, tokenizer)
        media, grids = media[:kept], grids[:kept]
        logger.warning("truncated sample %s to seq_length %d (%d of its media kept)", key, seq_length, kept)
        if not any(mask[1:]):
            logger.warning("skipped sample %s: no assistant token left after truncation", key)
            return None
    x = torch.tensor(ids, dtype=torch.long)
    return MultimodalSample(
        key=key,
        tokens=x[:-1],
        labels=x[1:],
        loss_mask=torch.tensor(mask[1:], dtype=torch.float32),
        media=media,
        grids=grids,
    )


def _truncate(
    ids: list[int], mask: list[int], limit: int, tokenizer: ChatTokenizer
) -> tuple[list[int], list[int], int]:
    """Cut to ``limit`` ids, never inside a media span: a span that does not fit is dropped with its
    ``<|vision_start|>``, and so are the media after it. Returns the number of media kept."""
    starts = [i for i, t in enumerate(ids) if t == tokenizer.vision.vision_start_token_id]
    ends = [i for i, t in enumerate(ids) if t == tokenizer.vision.vision_end_token_id]
    cut, kept = limit, 0
    for start, end in zip(starts, ends):
        if end < cut:
            kept += 1
        else:
            cut = min(cut, start)
            break
    return ids[:cut], mask[:cut], kept


def collate_multimodal(
    samples: Sequence[MultimodalSample],
    config: VisionProcessorConfig,
    *,
    capacity: int | None = None,
    pad_id: int = 0,
    segment_multiple: int = 1,
) -> dict:
    """One packed THD micro-batch of the samples (see :func:`loong_data.collate_packed`, also for
    ``segment_multiple``, context parallelism's padding of every sample) plus
    ``pixel_values [N, patch_dim]`` float32 / ``image_grid_thw [N_img, 3]`` int64 and
    ``pixel_values_videos`` / ``video_grid_thw`` (media in order of appearance; empty tensors when
    the pack has none)."""
    batch = collate_packed(
        [{"tokens": s.tokens, "labels": s.labels, "loss_mask": s.loss_mask} for s in samples],
        capacity=capacity,
        pad_id=pad_id,
        segment_multiple=segment_multiple,
    )
    pixels: dict[str, list[torch.Tensor]] = {"image": [], "video": []}
    grids: dict[str, list[torch.Tensor]] = {"image": [], "video": []}
    for sample in samples:
        for kind, frames in sample.media:
            try:
                p, g = process_image(frames[0], config) if kind == "image" else process_video(frames, config)
            except ValueError as e:
                raise MultimodalDataError(f"sample {sample.key}: {e}") from e
            pixels[kind].append(p)
            grids[kind].append(g)
    for kind, pv_key, grid_key in (
        ("image", "pixel_values", "image_grid_thw"),
        ("video", "pixel_values_videos", "video_grid_thw"),
    ):
        batch[pv_key] = torch.cat(pixels[kind]) if pixels[kind] else torch.zeros(0, config.patch_dim)
        batch[grid_key] = torch.stack(grids[kind]) if grids[kind] else torch.zeros(0, 3, dtype=torch.int64)
    return batch


class PackedMultimodalDataset(torch.utils.data.IterableDataset):
    """An infinite stream of packed multimodal micro-batches for one data-parallel rank.

    ``shards``: a folder written by ``loong-data convert-to-webdataset``, a ``.tar``, a glob or a
    list of shards. ``tokenizer``: a :class:`ChatTokenizer` or an HF tokenizer folder (default:
    the bundled chat tokenizer). ``on_error="skip"`` drops samples with bad media (logged and
    counted in :attr:`num_bad`) instead of raising. ``overflow``: what to do with a sample longer
    than ``seq_length``: ``truncate`` (cut at ``seq_length``, never inside an image; media that do not fit
    are dropped), ``skip`` or ``error``. ``start_pack`` skips that many packs (resume after
    ``start_pack`` consumed micro-batches). With ``pad_to_seq_length`` every pack is padded to
    ``seq_length`` tokens (static shapes). With DataLoader workers, worker ``w`` of ``W`` yields
    packs ``w, w + W, ...``, which the DataLoader interleaves back into the same order.
    """

    def __init__(
        self,
        shards: str | Path | Sequence[str | Path],
        tokenizer: ChatTokenizer | str | Path | None = None,
        *,
        seq_length: int,
        processor: VisionProcessorConfig | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle_buffer: int = 256,
        pack_buffer: int = 64,
        packing: str = "ffd",
        on_error: str = "raise",
        overflow: str = "truncate",
        pad_to_seq_length: bool = True,
        start_pack: int = 0,
    ) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if overflow not in OVERFLOW:
            raise ValueError(f"overflow must be one of {OVERFLOW}, got {overflow!r}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} must be in [0, dp_size={dp_size})")
        if seq_length < 2 or shuffle_buffer < 1 or pack_buffer < 1 or start_pack < 0:
            raise ValueError("seq_length >= 2, shuffle_buffer >= 1, pack_buffer >= 1, start_pack >= 0 required")
        self.shards = list_shards(shards)
        self.tokenizer = tokenizer if isinstance(tokenizer, ChatTokenizer) else load_chat_tokenizer(tokenizer)
        self.processor = processor or VisionProcessorConfig()
        self.seq_length, self.dp_rank, self.dp_size, self.seed = seq_length, dp_rank, dp_size, seed
        self.shuffle_buffer, self.pack_buffer = shuffle_buffer, pack_buffer
        self.strategy = packing_strategy(packing)
        self.on_error, self.overflow, self.pad_to_seq_length, self.start_pack = (
            on_error,
            overflow,
            pad_to_seq_length,
            start_pack,
        )
        self.num_bad = 0

    def raw_samples(self, epoch: int) -> Iterator[dict]:
        """This rank's raw WebDataset samples of ``epoch``, shuffled."""
        rng = random.Random(self.seed + epoch)
        order = list(self.shards)
        rng.shuffle(order)
        split_shards = len(order) >= self.dp_size
        mine = order[self.dp_rank :: self.dp_size] if split_shards else order
        buffer: list[dict] = []
        index = 0
        for shard in mine:
            try:
                for raw in _tar_samples(shard):
                    index += 1
                    if not split_shards and (index - 1) % self.dp_size != self.dp_rank:
                        continue
                    buffer.append(raw)
                    if len(buffer) >= self.shuffle_buffer:
                        yield buffer.pop(rng.randrange(len(buffer)))
            except MultimodalDataError:
                raise
            except Exception as e:  # tarfile / webdataset errors on a damaged shard
                message = f"shard {shard}: unreadable after {index} samples ({type(e).__name__}: {e})"
                if self.on_error == "raise":
                    raise MultimodalDataError(message) from e
                logger.warning("skipped the rest of %s", message)
                self.num_bad += 1
        rng.shuffle(buffer)
        yield from buffer

    def samples(self, epoch: int) -> Iterator[MultimodalSample]:
        """This rank's encoded samples of ``epoch``."""
        for raw in self.raw_samples(epoch):
            try:
                sample = encode_sample(
                    raw, self.tokenizer, self.processor, seq_length=self.seq_length, overflow=self.overflow
                )
            except MultimodalDataError as e:
                if self.on_error == "raise":
                    raise
                logger.warning("skipped %s", e)
                self.num_bad += 1
                continue
            if sample is not None:
                yield sample

    def packs(self) -> Iterator[list[MultimodalSample]]:
        """Packs (lists of samples, at most ``seq_length`` tokens together), forever."""
        epoch = 0
        while True:
            produced = False
            buffer: list[MultimodalSample] = []
            for sample in self.samples(epoch):
                buffer.append(sample)
                if len(buffer) == self.pack_buffer:
                    produced = True
                    yield from self._pack(buffer)
                    buffer = []
            if buffer:
                produced = True
                yield from self._pack(buffer)
            if not produced:
                raise MultimodalDataError(
                    f"rank {self.dp_rank}: no usable sample in {len(self.shards)} shard(s) "
                    f"(first: {self.shards[0]})"
                )
            epoch += 1

    def _pack(self, buffer: list[MultimodalSample]) -> Iterator[list[MultimodalSample]]:
        for pack in self.strategy.pack([len(s) for s in buffer], self.seq_length):
            yield [buffer[i] for i in pack]

    def collate(self, pack: Sequence[MultimodalSample]) -> dict:
        return collate_multimodal(
            pack,
            self.processor,
            capacity=self.seq_length if self.pad_to_seq_length else None,
            pad_id=self.tokenizer.pad_id,
        )

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for index, pack in enumerate(self.packs()):
            if index >= self.start_pack and (index - self.start_pack) % workers == worker:
                yield self.collate(pack)
