"""The ``data`` node of a training run: what to read and how it becomes samples. Each data kind's
own keys live in a nested config; :meth:`DataConfig.validate` checks what needs no other package
(cross-package rules, e.g. the model's context length, are the train app's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from loong_data.lerobot.stats import NormMode
from loong_data.packing import Strategy
from loong_data.step_data.diffusion import DiffusionDataConfig


class DataKind(StrEnum):
    text = "text"  # plain text corpora (pre-training)
    chat = "chat"  # JSONL conversations through a chat template, loss on the assistant's tokens (SFT)
    multimodal = "multimodal"  # conversations with images / videos (data.multimodal.*)
    lerobot = "lerobot"  # robot episodes in a LeRobot dataset: frames -> action chunks (data.lerobot.*)
    diffusion = "diffusion"  # captioned images / clips as VAE latents + text embeddings (data.diffusion.*)


class Packing(StrEnum):
    fixed = "fixed"  # seq_length windows of the token stream
    thd = "thd"  # variable-length samples packed into seq_length-token sequences with cu_seqlens


@dataclass
class ThdConfig:
    strategy: Strategy = Strategy.ffd
    buffer_size: int | None = None  # samples ffd reorders together; None = a rank's whole step
    # Documents are cut into samples of lognormal lengths (median, sigma), at most data.seq_length
    # tokens; long_fraction of the cuts are data.seq_length long (a long tail like mixed data).
    median_length: int = 96
    sigma: float = 1.0
    long_fraction: float = 0.0

    def errors(self) -> list[str]:
        errors = []
        if self.buffer_size is not None and self.buffer_size < 1:
            errors.append(f"data.thd.buffer_size={self.buffer_size} must be >= 1 or null")
        if self.median_length < 1 or self.sigma < 0 or not 0 <= self.long_fraction <= 1:
            errors.append("data.thd needs median_length >= 1, sigma >= 0 and long_fraction in [0, 1]")
        return errors


PREFETCH_MODES = ("auto", "thread", "process")


@dataclass
class MultimodalDataConfig:
    # A folder of WebDataset .tar shards (`loong-data convert-to-webdataset` writes them) ...
    shards: str | None = None
    # ... or JSONL files (one conversation + media paths per line) converted into data.cache_dir on
    # first use; media paths are relative to media_root (default: each JSONL file's folder).
    # Neither: the bundled real images with captions and questions.
    jsonl: list[str] = field(default_factory=list)
    media_root: str | None = None
    samples_per_shard: int = 64  # when converting JSONL
    val_shards: int = 1  # the last shards (in name order) are held out for evaluation
    # Image processor: every image is resized so that its pixel count lies in [min_pixels,
    # max_pixels] with sides divisible by patch_size * merge_size (those two come from the model).
    min_pixels: int = 56 * 56
    max_pixels: int = 448 * 448
    video_min_pixels: int = 56 * 56  # the same bounds for each video frame
    video_max_pixels: int = 448 * 448
    shuffle_buffer: int = 64  # samples shuffled together while streaming (0: stream order)
    # Where the next steps are decoded and packed while this one trains: "thread" (a thread of the
    # training process), "process" (a forked child process: its Python work never takes the
    # training loop's GIL; not with parallel.balance, whose plans change between steps) or "auto":
    # process for a CUDA run without a balancer (its loop is host-bound: 1.03-1.10x measured on
    # the H100 VLM bench), else thread (a CPU run's cores train; a balancer plans each step).
    prefetch: str = "auto"

    def errors(self) -> list[str]:
        errors = []
        if self.prefetch not in PREFETCH_MODES:
            errors.append(f"data.multimodal.prefetch={self.prefetch!r}: expected one of {', '.join(PREFETCH_MODES)}")
        if self.shards and self.jsonl:
            errors.append("data.multimodal.shards and data.multimodal.jsonl are exclusive: give shards or JSONL files")
        if self.samples_per_shard < 1:
            errors.append(f"data.multimodal.samples_per_shard={self.samples_per_shard} must be >= 1")
        if self.val_shards < 1:
            errors.append(f"data.multimodal.val_shards={self.val_shards} must be >= 1 (evaluation needs a held-out shard)")
        if not 0 < self.min_pixels <= self.max_pixels:
            errors.append(f"data.multimodal.min_pixels={self.min_pixels} and max_pixels={self.max_pixels} need "
                          "0 < min_pixels <= max_pixels")  # fmt: skip
        if not 0 < self.video_min_pixels <= self.video_max_pixels:
            errors.append(f"data.multimodal.video_min_pixels={self.video_min_pixels} and video_max_pixels="
                          f"{self.video_max_pixels} need 0 < video_min_pixels <= video_max_pixels")  # fmt: skip
        if self.shuffle_buffer < 0:
            errors.append(f"data.multimodal.shuffle_buffer={self.shuffle_buffer} must be >= 0")
        return errors


@dataclass
class LeRobotDataConfig:
    """A LeRobot dataset (v3.0 or v2.1) for a policy; the model-shaped keys are set from the model
    by the run's config (``${model.embodied.chunk_size}`` ...)."""

    root: str | None = None  # the dataset folder; None = the bundled Metaworld reach-v3 episodes
    horizon: int = 10  # action chunk length (the model's chunk_size)
    image_size: int = 64  # cameras are resized to the model's square input
    max_state_dim: int = 8
    max_action_dim: int = 8
    max_length: int = 48  # prompt tokens
    norm_mode: NormMode = NormMode.quantiles
    val_episodes: int = 2  # the last episodes are held out for evaluation

    def errors(self) -> list[str]:
        errors = []
        if self.horizon < 1 or self.image_size < 1 or self.max_length < 1:
            errors.append("data.lerobot.horizon, image_size and max_length must be >= 1")
        if self.val_episodes < 1:
            errors.append(f"data.lerobot.val_episodes={self.val_episodes} must be >= 1 (evaluation needs held-out episodes)")
        return errors


@dataclass
class DataConfig:
    kind: DataKind = DataKind.text  # chat with sources [] = the bundled Shakespeare QA
    # .txt files / folders of .txt / .jsonl ({"text": ...}); empty = the bundled Shakespeare corpus
    sources: list[str] = field(default_factory=list)
    tokenizer: str | None = None  # tokenizer.json or an HF folder; None = the bundled BPE
    cache_dir: str = "runs/data-cache"  # tokenised corpora, reused across runs
    seq_length: int = 256
    val_fraction: float = 0.02
    packing: Packing = Packing.fixed  # thd: no attention across documents
    thd: ThdConfig = field(default_factory=ThdConfig)
    multimodal: MultimodalDataConfig = field(default_factory=MultimodalDataConfig)
    lerobot: LeRobotDataConfig = field(default_factory=LeRobotDataConfig)
    diffusion: DiffusionDataConfig = field(default_factory=DiffusionDataConfig)

    def errors(self) -> list[str]:
        """Problems with the data keys, each naming the key (empty when fine)."""
        errors = []
        if self.kind == "chat" and self.packing != "fixed":
            errors.append("data.kind=chat trains one conversation per data.seq_length row: use data.packing=fixed")
        errors += self.thd.errors()
        if self.kind == "lerobot":
            errors += self.lerobot.errors()
        if self.kind == "multimodal":
            errors += self.multimodal.errors()
            if self.packing != "thd":
                errors.append(f"data.packing='{self.packing}': multimodal data is packed with cu_seqlens; "
                              "set data.packing=thd")  # fmt: skip
        if self.kind == "diffusion":
            errors += self.diffusion.errors()
        if not 0.0 < self.val_fraction < 1.0:
            errors.append(f"data.val_fraction={self.val_fraction} must be in (0, 1)")
        return errors
