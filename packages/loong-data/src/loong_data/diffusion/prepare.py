"""``loong-data diffusion-prepare``: captioned images / clips -> WebDataset shards of VAE latents
(diffusers ``AutoencoderKLWan``) and text embeddings (transformers ``UMT5EncoderModel``).

Each sample holds ``latents.pth`` ``[C, F, H, W]`` (normalised per channel with the set's mean and
std, recorded in ``meta.json`` so a sampler can undo it), ``context.pth`` ``[text_len, d]`` (the
encoder's output, zero past the caption's tokens, as Wan pads its umT5 context) and ``json``
(caption, frames, size). The towers are frozen: loaded from diffusers / HF directories, or built
from the model's ``vae`` / ``text_encoder`` configs with seeded random weights (no Wan or umT5
weights exist offline); either way they are saved under ``towers/`` so the latents can be decoded
and new captions encoded the same way. A second run with the same inputs reuses the shards
(``meta.json``'s fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from loong_data.bundled import SPM_TOKENIZER
from loong_data.diffusion.media import CaptionedMedia
from loong_data.log import logger

META = "meta.json"
# The towers of loong-models' wan-tiny (model/vae/tiny.yaml, model/text_encoder/tiny-umt5.yaml):
# the CLI's default; the train app passes the model config's own.
TINY_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[False, True])
TINY_TEXT_ENCODER = dict(vocab_size=32000, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2)


@dataclass(frozen=True)
class DiffusionShards:
    out_dir: Path
    meta: dict[str, Any]
    reused: bool


class Towers:
    """The frozen VAE, text encoder and tokenizer (built, or loaded from ``out/towers``)."""

    def __init__(self, vae, text_encoder, tokenizer, text_len: int) -> None:
        self.vae, self.text_encoder, self.tokenizer, self.text_len = vae.eval(), text_encoder.eval(), tokenizer, text_len
        tokenizer.padding_side = "right"  # the caption's tokens first, zeros after (Wan's context)

    @classmethod
    def build(cls, vae_cfg: dict, text_cfg: dict, *, text_len: int, seed: int, tokenizer: str | None = None,
              vae_dir: str | None = None, text_dir: str | None = None) -> Towers:  # fmt: skip
        from diffusers import AutoencoderKLWan
        from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

        torch.manual_seed(seed)
        vae = AutoencoderKLWan.from_pretrained(vae_dir) if vae_dir else AutoencoderKLWan(**vae_cfg)
        if text_dir:
            enc = UMT5EncoderModel.from_pretrained(text_dir)
        else:
            enc = UMT5EncoderModel(UMT5Config(**text_cfg, is_encoder_decoder=False))
        tok = AutoTokenizer.from_pretrained(tokenizer or text_dir or SPM_TOKENIZER)
        if len(tok) > enc.config.vocab_size:
            raise ValueError(f"tokenizer {tokenizer or SPM_TOKENIZER} has {len(tok)} tokens but the text encoder's "
                             f"vocab_size is {enc.config.vocab_size}")  # fmt: skip
        return cls(vae, enc, tok, text_len)

    @classmethod
    def load(cls, out: Path) -> Towers:
        from diffusers import AutoencoderKLWan
        from transformers import AutoTokenizer, UMT5EncoderModel

        meta = json.loads((out / META).read_text())
        t = out / "towers"
        return cls(AutoencoderKLWan.from_pretrained(t / "vae"), UMT5EncoderModel.from_pretrained(t / "text_encoder"),
                   AutoTokenizer.from_pretrained(t / "tokenizer"), meta["text_len"])  # fmt: skip

    def save(self, out: Path) -> None:
        self.vae.save_pretrained(out / "vae")
        self.text_encoder.save_pretrained(out / "text_encoder")
        self.tokenizer.save_pretrained(out / "tokenizer")

    @torch.no_grad()
    def encode_text(self, captions: list[str]) -> torch.Tensor:
        """[n, text_len, d]: umT5 features of each caption, zero past its tokens."""
        enc = self.tokenizer(captions, max_length=self.text_len, truncation=True, padding="max_length",
                             return_tensors="pt")  # fmt: skip
        h = self.text_encoder(input_ids=enc.input_ids, attention_mask=enc.attention_mask).last_hidden_state
        return h * enc.attention_mask[..., None]

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """[b, 3, F, H, W] in [-1, 1] -> latents [b, z, F', H', W'] (the posterior's mean)."""
        return self.vae.encode(video).latent_dist.mode()

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents).sample.clamp(-1, 1)


def load_frames(item: CaptionedMedia, size: int, temporal: int) -> torch.Tensor:
    """[3, F, size, size] in [-1, 1]: each frame resized (shorter side) and centre-cropped; a clip
    keeps 1 + temporal * k frames (the causal VAE's valid lengths)."""
    paths = item.frames[: 1 + temporal * ((len(item.frames) - 1) // temporal)]
    out = []
    for p in paths:
        try:
            im = Image.open(p).convert("RGB")
        except OSError as e:
            raise ValueError(f"{item.id}: cannot read image {p} ({e})") from None
        s = size / min(im.size)
        im = im.resize((max(size, round(im.width * s)), max(size, round(im.height * s))), Image.BICUBIC)
        left, top = (im.width - size) // 2, (im.height - size) // 2
        im = im.crop((left, top, left + size, top + size))
        out.append(torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(size, size, 3))
    return torch.stack(out).permute(3, 0, 1, 2).float() / 127.5 - 1


def _fingerprint(items: list[CaptionedMedia], settings: dict) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for it in items:
        h.update(f"{it.id}\0{it.caption}\0".encode())
        for f in it.frames:
            h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def prepare_diffusion_shards(items: list[CaptionedMedia], out: str | Path, *, vae: dict, text_encoder: dict,
                             text_len: int, size: int, seed: int = 0, tokenizer: str | None = None,
                             vae_dir: str | None = None, text_dir: str | None = None, maxcount: int = 256,
                             batch: int = 64) -> DiffusionShards:  # fmt: skip
    """Encode ``items`` into shards under ``out`` (reused when the fingerprint matches)."""
    import webdataset as wds

    out = Path(out)
    settings = dict(vae=vae, text_encoder=text_encoder, text_len=text_len, size=size, seed=seed,
                    tokenizer=tokenizer, vae_dir=vae_dir, text_dir=text_dir, format=1)  # fmt: skip
    fp = _fingerprint(items, settings)
    if (out / META).is_file() and (meta := json.loads((out / META).read_text())).get("fingerprint") == fp:
        return DiffusionShards(out, meta, True)
    if not items:
        raise ValueError("diffusion-prepare: no captioned media to encode")
    towers = Towers.build(vae, text_encoder, text_len=text_len, seed=seed, tokenizer=tokenizer,
                          vae_dir=vae_dir, text_dir=text_dir)  # fmt: skip
    temporal = 4  # AutoencoderKLWan encodes the first frame, then chunks of 4: clips of 1 + 4k frames
    latents, contexts = _encode_all(items, towers, size, temporal, batch)
    flat = torch.cat([z.flatten(1) for z in latents], dim=1)  # per channel over every sample
    mean, std = flat.mean(1), flat.std(1)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with wds.ShardWriter(str(tmp / "shard-%06d.tar"), maxcount=maxcount, verbose=0) as sink:
        for it, z, c in zip(items, latents, contexts):
            zn = (z - mean[:, None, None, None]) / std[:, None, None, None]
            sink.write({"__key__": it.id.replace(".", "_"), "latents.pth": zn.contiguous(), "context.pth": c.contiguous(),
                        "json": {"id": it.id, "caption": it.caption, "frames": len(it.frames), "size": size}})  # fmt: skip
    towers.save(tmp / "towers")
    meta = dict(fingerprint=fp, num_samples=len(items), latent_mean=mean.tolist(), latent_std=std.tolist(),
                text_len=text_len, size=size, settings=settings,
                shards=sorted(p.name for p in tmp.glob("shard-*.tar")))  # fmt: skip
    (tmp / META).write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    logger.info("diffusion-prepare: %d samples -> %s", len(items), out)
    return DiffusionShards(out, meta, False)


def _encode_all(items, towers: Towers, size: int, temporal: int, batch: int):
    videos = [load_frames(it, size, temporal) for it in items]
    contexts = []
    for i in range(0, len(items), batch):
        contexts.extend(towers.encode_text([it.caption for it in items[i : i + batch]]))
    latents: list[torch.Tensor | None] = [None] * len(items)
    by_shape: dict[tuple, list[int]] = {}
    for i, v in enumerate(videos):
        by_shape.setdefault(tuple(v.shape), []).append(i)
    for idx in by_shape.values():
        for j in range(0, len(idx), batch):
            part = idx[j : j + batch]
            for i, z in zip(part, towers.encode_video(torch.stack([videos[i] for i in part]))):
                latents[i] = z
    return latents, contexts


def settings_of(model_vae, model_text) -> tuple[dict, dict]:
    """The tower kwargs of loong-models' ``VaeConfig`` / ``TextEncoderConfig``."""
    text = {k: v for k, v in asdict(model_text).items() if k != "tokenizer"}
    return model_vae.kwargs(), text
