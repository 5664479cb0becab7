"""Diffusion data: captioned images / clips -> VAE latents + text embeddings in WebDataset shards,
and the per-rank batches the trainer draws from them."""

from loong_data.diffusion.media import CaptionedMedia, bundled_captioned_media
from loong_data.diffusion.prepare import DiffusionShards, Towers, prepare_diffusion_shards
from loong_data.diffusion.samples import LatentSamples, load_latent_samples

__all__ = [
    "CaptionedMedia",
    "DiffusionShards",
    "LatentSamples",
    "Towers",
    "bundled_captioned_media",
    "load_latent_samples",
    "prepare_diffusion_shards",
]
