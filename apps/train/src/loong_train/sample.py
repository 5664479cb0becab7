"""``uv run sample``: look at what a diffusion checkpoint learned.

    uv run sample runs/wan/checkpoints/step_00000300 --data runs/wan/data --out runs/wan/samples
    uv run sample CKPT --data DIR --caption "Chelsea the cat." --caption "A handwritten digit 7."

Integrates the flow from seeded noise with Euler steps (``loong_models.diffusion.euler_sample``)
for each caption (default: every caption of the prepared set, at the latent shape of its
sample), undoes the set's latent normalisation, decodes with the set's saved VAE and writes one
PNG per image (a GIF per clip) and ``grid.png`` (samples over their training images).
``retrieval.json`` says, per caption of the set, whether the sample is nearer (L2, latent space)
to its own training latent than to any other: the fraction is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sample", description="Sample frames from a Wan checkpoint (flow-matching Euler).")
    ap.add_argument("checkpoint", type=Path, help="a Loong checkpoint of a diffusion model")
    ap.add_argument("--data", type=Path, required=True, help="prepared shard folder (its towers/ and meta.json)")
    ap.add_argument("--out", type=Path, required=True, help="output folder for PNG / GIF files")
    ap.add_argument("--caption", action="append", help="caption to sample (repeatable; default: the set's)")
    ap.add_argument("--limit", type=int, default=32, help="at most this many of the set's captions")
    ap.add_argument("--steps", type=int, default=20, help="Euler steps")
    ap.add_argument("--shift", type=float, default=5.0, help="timestep shift of the schedule")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    return ap


def _to_images(video: torch.Tensor):
    """[3, F, H, W] in [-1, 1] -> F PIL images."""
    from PIL import Image

    frames = ((video.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 3, 0).numpy()
    return [Image.fromarray(f) for f in frames]


def _load_model(checkpoint: Path):
    from loong_ckpt.components import config_from_meta
    from loong_ckpt.training import load_checkpoint, read_checkpoint_info
    from loong_models import build_model, build_transformer_config

    cfg = config_from_meta(read_checkpoint_info(checkpoint).meta)
    if getattr(cfg, "diffusion", None) is None:
        raise ValueError(f"{checkpoint}: loong.json records no diffusion model (model.diffusion)")
    cfg.layer_backend = "local"
    base = build_transformer_config(cfg.foundation, use_cpu_initialization=True, params_dtype=torch.float32)
    model = build_model(cfg, base, device_type="cpu").eval()
    load_checkpoint(checkpoint, [model])
    return model


def sample(args: argparse.Namespace) -> dict:
    from loong_data.diffusion import Towers, load_latent_samples
    from loong_models.diffusion import euler_sample

    data, towers = load_latent_samples(args.data), Towers.load(args.data)
    model = _load_model(args.checkpoint)
    own = args.caption is None
    captions = args.caption or data.captions[: args.limit]
    shape = {c: tuple(z.shape) for c, z in zip(data.captions, data.latents)}
    mean = torch.tensor(data.meta["latent_mean"])[:, None, None, None]
    std = torch.tensor(data.meta["latent_std"])[:, None, None, None]
    args.out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(args.seed)
    hits, rows = [], []
    for k, caption in enumerate(captions):
        ctx = towers.encode_text([caption])
        noise = torch.randn((1, *shape.get(caption, data.latents[0].shape)), generator=g)
        with torch.no_grad():
            z = euler_sample(lambda x, t, c=ctx: model(x, t, c), noise, steps=args.steps, shift=args.shift)[0]
        if own:
            dist = torch.stack([(z - y).pow(2).sum() if y.shape == z.shape else torch.tensor(float("inf"))
                                for y in data.latents])  # fmt: skip
            hits.append(data.captions[int(dist.argmin())] == caption)
        frames = _to_images(towers.decode((z * std + mean)[None])[0])
        name = f"{k:03d}"
        if len(frames) == 1:
            frames[0].save(args.out / f"{name}.png")
        else:
            frames[0].save(args.out / f"{name}.gif", save_all=True, append_images=frames[1:], duration=200, loop=0)
        rows.append(frames[0])
    _grid(rows, args.out / "grid.png")
    report = {"captions": captions, "steps": args.steps, "seed": args.seed}
    if own:
        report.update(nearest_is_own=hits, fraction=sum(hits) / len(hits))
    (args.out / "retrieval.json").write_text(json.dumps(report, indent=2))
    return report


def _grid(images, path: Path, cols: int = 8) -> None:
    from PIL import Image

    w, h = images[0].size
    grid = Image.new("RGB", (w * min(cols, len(images)), h * -(-len(images) // cols)))
    for i, im in enumerate(images):
        grid.paste(im, ((i % cols) * w, (i // cols) * h))
    grid.save(path)


def main(argv: list[str] | None = None) -> int:
    import warnings

    from loong_xpu import get_accelerator
    from loong_xpu.testing import megatron_world

    warnings.filterwarnings("ignore")
    args = _parser().parse_args(argv)
    try:
        with megatron_world(get_accelerator("cpu")):
            report = sample(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"sample: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(report['captions'])} samples to {args.out} (grid.png)")
    if "fraction" in report:
        print(f"nearest training latent is the caption's own: {report['fraction']:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
