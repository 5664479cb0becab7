"""Loong vs HF transformers: VLM training throughput (Qwen2.5-VL-style) on one GPU, in one run.

Both sides train the same shape (default: Qwen2.5-VL-3B's vision tower and language model, the
language model cut to --text-layers so AdamW fits one 80 GB GPU; random init) on the same
micro-batches: real bundled images resized to --image-size (448x448: 1024 patches, 256 image
tokens each), --images-per-sample images with their real captions per sample, packed into
--seq-token sequences by the train app's multimodal data path (the HF worker builds its
micro-batches with the same code, config and seed, and checks they hold the same tokens and
images). bf16 with fp32 master weights, AdamW (lr 3e-4, betas 0.9/0.95, wd 0.1, clip 1.0).
Loong runs the real train app (`--config-name vlm`, TE layers when transformer-engine is
installed, THD packing: attention stays inside each sample); HF runs
Qwen2_5_VLForConditionalGeneration with SDPA under torch.autocast, fed each pack as one causal
sequence (HF's SDPA path has no packed-sequence attention; it attends across the samples of a
pack, more attention work than Loong does). Each side runs in its own process; the table reports
the median over the steps after warm-up.

    python bench/vlm_throughput.py                        # both, default shape
    python bench/vlm_throughput.py --text-layers 36 --steps 20 --warmup 5
    python bench/vlm_throughput.py --loong-extra model.layer_backend=local
    python bench/vlm_throughput.py --hf-modes --variants thread= process=data.multimodal.prefetch=process --repeats 2

``--variants label=override,override ...`` runs Loong once per variant on the same data (asserted),
``--repeats N`` alternates them N times (A B A B: step times drift between runs) and prints each
variant's per-run medians. ``--text-only`` also prints the ratio's ceiling at equal MFU: text-only
FLOPs per token / vision-mix FLOPs per token (an image token also pays the ViT over its patches).

Before any figure, the script asserts that every run trained on the same data at every step: the
same samples, tokens and images, each counted by the stack itself (Loong's metrics.jsonl, the HF
worker's own batches), and the same digest of token ids and image grids (`batch_digest`).
tokens/s counts each stack's own LLM tokens (image tokens included, padding excluded). MFU = step
FLOPs / step time / 989 TFLOP/s, step FLOPs = LLM 6 N per token + attention 6 L h per pair of
tokens of the same sample (DESIGN.md's 6 L h s with s each sample's real length, not the pack's)
+ vision tower (loong_models.flops, as the train app's MFU: 6 N per patch + bidirectional attention
over the frame or window).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from same_data import check_same_data  # noqa: E402
from train_app import run_train_app  # noqa: E402
from vlm_flops import PEAK_BF16, step_counts, text_only_ceiling  # noqa: E402


@dataclass(frozen=True)
class TextShape:
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_embeddings: bool
    rope_theta: float
    mrope_section: tuple[int, ...]
    norm_eps: float
    max_position_embeddings: int

    def num_parameters(self) -> int:
        """Qwen2 LLM: qkv with bias, o without, gated MLP, two RMSNorms per layer, final norm."""
        h, f, d = self.hidden, self.ffn, self.head_dim
        q, kv = self.heads * d, self.kv_heads * d
        attn = h * q + q + 2 * (h * kv + kv) + q * h
        layer = attn + 3 * h * f + 2 * h
        emb = self.vocab * h * (1 if self.tie_embeddings else 2)
        return emb + self.num_layers * layer + h


@dataclass(frozen=True)
class VisionShape:
    """The ViT + patch merger sizes HF's Qwen2.5-VL config takes."""

    depth: int
    hidden: int
    ffn: int
    out_hidden: int
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2
    window_size: int = 112  # pixels; windowed layers attend within window_size x window_size
    fullatt_blocks: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch * self.patch * self.patch


@dataclass(frozen=True)
class BenchShape:
    text: TextShape
    vision: VisionShape
    vision_heads: int


def bench_shape(model) -> BenchShape:
    """The shape of a Loong VLM ModelConfig (Qwen2.5-VL ViT + patch merger + Qwen2 LLM), which
    both sides build: Loong from the config, HF through :func:`hf_config`."""
    f, e = model.foundation, model.image_encoder
    if f.family != "qwen2" or e.type != "qwen2.5-vit" or model.image_projector.norm != "RMSNorm":
        raise ValueError(f"HF Qwen2.5-VL is a qwen2.5-vit + patch merger + qwen2 LLM; the model has "
                         f"{e.type} + {model.image_projector.norm} projector + {f.family}")  # fmt: skip
    text = TextShape(
        num_layers=f.num_layers, hidden=f.hidden_size, ffn=f.ffn_hidden_size, heads=f.num_attention_heads,
        kv_heads=f.query_groups, head_dim=f.head_dim, vocab=f.vocab_size, tie_embeddings=f.tie_word_embeddings,
        rope_theta=f.rotary_base, mrope_section=tuple(f.mrope_section), norm_eps=f.norm_epsilon,
        max_position_embeddings=f.max_position_embeddings,
    )  # fmt: skip
    vision = VisionShape(
        depth=e.num_layers, hidden=e.hidden_size, ffn=e.ffn_hidden_size, out_hidden=f.hidden_size,
        patch=e.patch_size, temporal_patch=e.temporal_patch_size, merge=e.spatial_merge_size,
        window_size=e.window_size, fullatt_blocks=tuple(e.fullatt_block_indexes), in_channels=e.in_channels,
    )  # fmt: skip
    return BenchShape(text, vision, e.num_attention_heads)


def hf_config(shape: BenchShape, token_ids: dict[str, int]):
    """The transformers config of the same shape, vision token ids from the tokenizer."""
    from transformers import Qwen2_5_VLConfig

    t, v = shape.text, shape.vision
    if t.head_dim * t.heads != t.hidden:
        raise ValueError(f"HF Qwen2.5-VL needs head dim = hidden / heads; the model has {t.head_dim} x {t.heads} "
                         f"!= {t.hidden}")  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=t.vocab, hidden_size=t.hidden, intermediate_size=t.ffn, num_hidden_layers=t.num_layers,
            num_attention_heads=t.heads, num_key_value_heads=t.kv_heads, rms_norm_eps=t.norm_eps,
            max_position_embeddings=t.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta, "mrope_section": list(t.mrope_section)},
        ),
        vision_config=dict(
            depth=v.depth, hidden_size=v.hidden, intermediate_size=v.ffn, num_heads=shape.vision_heads,
            out_hidden_size=v.out_hidden, patch_size=v.patch, temporal_patch_size=v.temporal_patch,
            spatial_merge_size=v.merge, window_size=v.window_size, fullatt_block_indexes=list(v.fullatt_blocks),
        ),
        tie_word_embeddings=t.tie_embeddings,
        **token_ids,
        attn_implementation="sdpa",
    )  # fmt: skip


def hf_inputs(mb: dict, image_token_id: int, video_token_id: int) -> dict:
    """One packed micro-batch of the contract as HF Qwen2.5-VL inputs. HF shifts labels itself
    (position i predicts labels[i + 1]); the contract's labels are already next-token targets,
    so they move one place right, with -100 where the loss mask is zero."""
    import torch

    tokens = mb["tokens"]
    targets = torch.where(mb["loss_mask"] > 0, mb["labels"], torch.full_like(mb["labels"], -100))
    labels = torch.cat([torch.full_like(targets[:, :1], -100), targets[:, :-1]], dim=1)
    mm_types = (tokens == image_token_id).int() + 2 * (tokens == video_token_id).int()
    out = {"input_ids": tokens, "labels": labels, "mm_token_type_ids": mm_types}
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if pixels in mb and mb[pixels].numel():  # packs without images / videos carry empty tensors
            out[pixels], out[grid] = mb[pixels], mb[grid]
    return out


def unpack(mb: dict, pad_id: int, image_token_id: int, video_token_id: int, merge: int) -> list[dict]:
    """The samples of a packed micro-batch, each with its own images / videos (as an HF user's
    dataset yields them): tokens by ``cu_seqlens`` (the padding tail dropped), pixel rows and
    grids by the placeholder tokens each sample holds."""
    cu = [int(x) for x in mb["cu_seqlens"].tolist()]
    tokens = mb["tokens"][0]
    media = {}
    for kind, token_id, pixels, grid in (("image", image_token_id, "pixel_values", "image_grid_thw"),
                                         ("video", video_token_id, "pixel_values_videos", "video_grid_thw")):  # fmt: skip
        grids = mb[grid].tolist() if grid in mb else []
        media[kind] = (token_id, pixels, grid, grids, [0, 0])  # next grid row, next pixel row
    out = []
    for lo, hi in zip(cu[:-1], cu[1:]):
        if not bool(mb["loss_mask"][0, lo:hi].any()) and bool((tokens[lo:hi] == pad_id).all()):
            continue  # the padding tail
        sample = {k: mb[k][0, lo:hi] for k in ("tokens", "labels", "loss_mask")}
        for token_id, pixels, grid, grids, cursor in media.values():
            want = int((tokens[lo:hi] == token_id).sum())
            g0, p0 = cursor
            while want > 0:
                t, h, w = grids[cursor[0]]
                want -= t * h * w // merge**2
                cursor[0] += 1
                cursor[1] += t * h * w
            sample[grid] = mb[grid][g0 : cursor[0]]
            sample[pixels] = mb[pixels][p0 : cursor[1]]
        out.append(sample)
    return out


def hf_batch(samples: list[dict], pad_id: int, image_token_id: int, video_token_id: int) -> dict:
    """Samples as one HF batch, the way an HF user batches them: right-padded to the longest
    sample (+1: the slot where HF's shifted labels keep each sample's last target) with an
    attention mask, labels -100 on padding and outside the loss mask (shifted as in
    :func:`hf_inputs`), pixels of all samples concatenated in order."""
    import torch

    longest = max(int(s["tokens"].shape[0]) for s in samples) + 1
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for i, s in enumerate(samples):
        n = int(s["tokens"].shape[0])
        ids[i, :n], mask[i, :n] = s["tokens"], 1
        targets = torch.where(s["loss_mask"] > 0, s["labels"], torch.full_like(s["labels"], -100))
        labels[i, 1 : n + 1] = targets
    mm_types = (ids == image_token_id).int() + 2 * (ids == video_token_id).int()
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels, "mm_token_type_ids": mm_types}
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        parts = [s[pixels] for s in samples if pixels in s and s[pixels].numel()]
        if parts:
            out[pixels] = torch.cat(parts)
            out[grid] = torch.cat([s[grid] for s in samples if grid in s and s[grid].numel()])
    return out


# --- the data: real bundled images at a fixed resolution, several per sample, real captions ---------


def bundled_captions() -> list[tuple[Path, str]]:
    """(image, caption) of loong-data's bundled photos (their ``caption-*`` conversations)."""
    from loong_data.multimodal import default_multimodal_dataset

    root = default_multimodal_dataset()
    out = []
    for line in (root / "conversations.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if not str(record.get("id", "")).startswith("caption-"):
            continue
        user, assistant = record["messages"][0]["content"], record["messages"][1]["content"]
        image = next(item["image"] for item in user if item["type"] == "image")
        text = (
            assistant
            if isinstance(assistant, str)
            else " ".join(i["text"] for i in assistant if i["type"] == "text")
        )
        out.append((root / image, text))
    if not out:
        raise SystemExit(f"no caption-* conversations in {root}")
    return out


def write_bench_data(out: Path, *, image_size: int, images_per_sample: int, num_samples: int,
                     text_only: bool = False) -> Path:  # fmt: skip
    """JSONL + images for `data.multimodal.jsonl`: each sample shows ``images_per_sample`` bundled
    photos resized to ``image_size`` x ``image_size`` and the assistant gives their captions.
    ``text_only``: each photo is replaced by text of as many tokens (its caption, repeated), so the
    samples and packs have the lengths of the multimodal ones without any image."""
    from PIL import Image

    pairs = bundled_captions()
    (out / "images").mkdir(parents=True, exist_ok=True)
    names = []
    for path, _ in pairs:
        name = f"images/{path.stem}.png"
        with Image.open(path) as im:
            im.convert("RGB").resize((image_size, image_size), Image.Resampling.BICUBIC).save(out / name)
        names.append(name)
    if text_only:  # <|vision_start|> + (size / 28)**2 image tokens + <|vision_end|>
        names = [text_filler(caption, (image_size // 28) ** 2 + 2) for _, caption in pairs]
    lines = []
    for i in range(num_samples):
        picks = [(i * images_per_sample + j) % len(pairs) for j in range(images_per_sample)]
        content = [{"type": "text", "text": names[k]} if text_only else {"type": "image", "image": names[k]}
                   for k in picks]  # fmt: skip
        content.append({"type": "text", "text": f"Describe these {images_per_sample} images, in order."})
        answer = " ".join(f"{n + 1}. {pairs[k][1]}" for n, k in enumerate(picks))
        lines.append(json.dumps({"id": f"bench-{i}", "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]}))  # fmt: skip
    jsonl = out / "bench.jsonl"
    jsonl.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return jsonl


def text_filler(text: str, tokens: int) -> str:
    """``text`` repeated and cut to about ``tokens`` tokens of the bundled chat tokenizer."""
    from loong_data.multimodal import load_chat_tokenizer

    hf = load_chat_tokenizer(None).hf
    words = text.split()
    out: list[str] = []
    while len(hf.encode(" ".join(out), add_special_tokens=False)) < tokens:
        out.append(words[len(out) % len(words)])
    return " ".join(out)


def train_overrides(args, jsonl: Path, workdir: Path) -> list[str]:
    """The train-app overrides of the benchmark job (`--config-name vlm`); the HF worker composes
    the same config to build the same micro-batches."""
    from loong_data.multimodal import load_chat_tokenizer
    from loong_models import load_model_config

    base = load_model_config(args.model)
    full = [i for i in base.image_encoder.fullatt_block_indexes if i < args.vision_layers]
    v = load_chat_tokenizer(None).vision  # the bundled chat tokenizer: the model uses its ids
    pixels = args.image_size * args.image_size
    per_shard = max(1, args.num_samples // 4)
    return [
        f"model={args.model}", f"model.foundation.num_layers={args.text_layers}",
        f"model.image_encoder.num_layers={args.vision_layers}",
        f"model.image_encoder.fullatt_block_indexes=[{','.join(map(str, full))}]",
        *(f"model.{key}={i}" for key, i in asdict(v).items()),  # the vision token ids
        f"data.multimodal.jsonl=[{jsonl}]", f"data.multimodal.min_pixels={pixels}",
        f"data.multimodal.max_pixels={pixels}", f"data.multimodal.samples_per_shard={per_shard}",
        f"data.seq_length={args.seq}", f"data.cache_dir={workdir}/data-cache",
        f"train.global_batch_size={args.samples_per_step}", "train.micro_batch_size=1", f"train.dtype={args.dtype}",
        *args.model_overrides,
    ]  # fmt: skip


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from loong_train.main import to_config

    with initialize_config_module("loong_train.configs", version_base=None):
        return to_config(hydra_compose("vlm", overrides=overrides))


# --- the two stacks ------------------------------------------------------------------------------


def run_loong(args, overrides: list[str], out: Path) -> tuple[list[float], float, list[dict]]:
    cmd = [
        sys.executable, "-m", "loong_train", "--config-name=vlm", *overrides, f"train.steps={args.steps}",
        "train.eval_iters=0", "train.save_final=false", "train.tensorboard=false", "train.progress=false",
        f"train.output_dir={out}", "optim.lr=3e-4", "optim.min_lr=3e-5", f"optim.warmup_steps={args.warmup}",
        *args.loong_extra,
    ]  # fmt: skip
    print("loong:", " ".join(cmd[2:]), flush=True)
    train = run_train_app(cmd, out, label="loong run")
    counts = [{k: r[f"step_{k}"] for k in SAME_DATA} for r in train]
    return [r["step_time_s"] for r in train], max(r["peak_mem_gib"] for r in train), counts


def parse_variants(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``label=ov1,ov2`` -> (label, [ov1, ov2]); ``label=`` is the run with no extra overrides."""
    variants = []
    for spec in specs:
        label, sep, extra = spec.partition("=")
        if not sep or not label:
            raise SystemExit(f"--variants {spec!r}: expected label=override,override (or label= for none)")
        variants.append((label, [o for o in extra.split(",") if o]))
    return variants


def loong_rows(args, overrides: list[str], work: Path) -> list[Row]:
    """One Loong run per variant (on top of --loong-extra), the variants alternated ``--repeats``
    times (A B A B: step times drift between runs of one config, so a lever is read off
    alternated runs, not off one run each). Rows are named ``loong <label> #<repeat>``."""
    rows = []
    for repeat in range(1, args.repeats + 1):
        for label, extra in parse_variants(args.variants):
            run = argparse.Namespace(**{**vars(args), "loong_extra": [*args.loong_extra, *extra]})
            times, peak, counts = run_loong(run, overrides, work / f"loong-{label}-{repeat}")
            rows.append(Row(f"loong {label} #{repeat}", times, peak, counts))
    return rows


def variant_summary(rows: list[Row], warmup: int) -> list[str]:
    """Per variant: its runs' median step times, and their mean relative to the first variant's."""
    by_label: dict[str, list[float]] = {}
    for r in rows:
        if r.name.startswith("loong "):
            label = r.name.split()[1]
            by_label.setdefault(label, []).append(statistics.median(r.step_times[warmup:]))
    if len(by_label) < 2 and all(len(v) < 2 for v in by_label.values()):
        return []
    base = statistics.mean(next(iter(by_label.values())))
    lines = ["", "variant: median step s of each run -> mean (first variant's mean / this one's: speed-up)"]
    for label, medians in by_label.items():
        mean = statistics.mean(medians)
        lines.append(f"  {label:<12} {' '.join(f'{m:.3f}' for m in medians)} -> {mean:.3f} s  ({base / mean:.3f}x)")
    return lines


def run_loong_text_only(args, work: Path) -> dict:
    """The same LLM on text-only packs of the same length (each image of the bench's samples
    replaced by as many text tokens; encoder and projector frozen and never run): its tokens/s
    and the train app's MFU (NaN without a known peak: CPU) over the steps after warm-up."""
    jsonl = write_bench_data(work / "data", image_size=args.image_size, images_per_sample=args.images_per_sample,
                             num_samples=args.num_samples, text_only=True)  # fmt: skip
    frozen = ["++model.image_encoder.freeze=true", "++model.image_projector.freeze=true"]
    overrides = [*train_overrides(args, jsonl, work), *frozen]
    cmd = [
        sys.executable, "-m", "loong_train", "--config-name=vlm", *overrides,
        f"train.steps={args.steps}", "train.eval_iters=0", "train.save_final=false", "train.tensorboard=false",
        "train.progress=false", f"train.output_dir={work / 'run'}", "optim.lr=3e-4", "optim.min_lr=3e-5",
        f"optim.warmup_steps={args.warmup}", *args.loong_extra,
    ]  # fmt: skip
    print("loong text-only:", " ".join(cmd[2:]), flush=True)
    rows = run_train_app(cmd, work / "run", label="loong text-only run")[args.warmup :]
    if any(r["step_images"] for r in rows):
        raise SystemExit("the text-only run's packs hold images")
    t = sum(r["step_time_s"] for r in rows)
    return {"tokens_per_s": sum(r["step_tokens"] for r in rows) / t, "mfu": statistics.mean(r.get("mfu", math.nan) for r in rows),
            "tokens_per_step": statistics.mean(r["step_tokens"] for r in rows),
            "peak_gib": max(r["peak_mem_gib"] for r in rows),
            "counts": data_counts(compose(overrides), args.steps)[args.warmup :]}  # the text packs' FLOPs  # fmt: skip


def hf_worker(args) -> None:
    """Runs in its own process: train HF Qwen2_5_VLForConditionalGeneration on the train app's
    micro-batches; print one JSON line of step times and per-step counts."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from loong_data.step_data import batch_digest
    from loong_train.trainer import run_data, step_layout

    overrides = json.loads(args.overrides)
    cfg = compose(overrides)
    shape = bench_shape(cfg.model)
    m = cfg.model
    ids = asdict(m.vision_token_ids)
    data = run_data(cfg, step_layout(cfg, num_microbatches=cfg.train.global_batch_size // cfg.train.micro_batch_size))
    batches = data.train_steps()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only to smoke-test this script
    dtype = torch.float32 if args.hf_mode == "amp" else torch.bfloat16
    model = Qwen2_5_VLForConditionalGeneration(hf_config(shape, ids)).to(device, dtype=dtype)
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda"
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, counts = [], []
    merge = cfg.model.image_encoder.spatial_merge_size

    def hf_steps():  # an HF user's loader: the step's samples, batched and padded, prepared ahead
        for mbs in batches:
            samples = [s for mb in mbs for s in unpack(mb, data.tokenizer.pad_id, m.image_token_id,
                                                         m.video_token_id, merge)]  # fmt: skip
            hf = [hf_batch(samples[i : i + args.hf_batch_size], data.tokenizer.pad_id, m.image_token_id,
                           m.video_token_id) for i in range(0, len(samples), args.hf_batch_size)]  # fmt: skip
            yield mbs, samples, hf

    steps = hf_steps()  # already prefetched by the train app's data path, like Loong's
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()  # like the train app's step time: building the step's batches included
        mbs, samples, hf = next(steps)
        loss_tokens = sum(float(s["loss_mask"].sum()) for s in samples)
        for batch in hf:
            inputs = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            weight = float((batch["labels"] != -100).sum()) / loss_tokens  # the step's per-token mean
            with torch.autocast(device, dtype=torch.bfloat16, enabled=args.hf_mode == "amp"):
                loss = model(**inputs).loss * weight
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        sync()
        times.append(time.perf_counter() - t0)
        c = step_counts(mbs, m, data.tokenizer.pad_id)
        hf_tokens = sum(int(s["tokens"].shape[0]) for s in samples)
        hf_images = sum(int(s["image_grid_thw"].shape[0]) for s in samples if "image_grid_thw" in s)
        if (hf_tokens, hf_images) != (c.tokens, c.images):
            raise SystemExit(f"HF batches hold {hf_tokens} tokens / {hf_images} images, the packs {c.tokens} / {c.images}")
        # its own counts (of the samples it batched, checked against the packs above) and the packs' digest
        counts.append({"tokens": hf_tokens, "images": hf_images, "patches": c.patches, "vision_flops": c.vision_flops,
                       "samples": len(samples), "digest": batch_digest(mbs), "flops": c.flops})  # fmt: skip
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    print(json.dumps({"step_times": times, "counts": counts, "peak_gib": peak,
                      "params": sum(p.numel() for p in model.parameters())}))  # fmt: skip


def data_counts(cfg, steps: int) -> list[dict]:
    """Per step, what the train app's packs hold and their FLOPs (vlm_flops.step_counts), from the
    same data path (for runs without an HF worker, which otherwise counts them)."""
    from loong_train.trainer import run_data, step_layout

    data = run_data(cfg, step_layout(cfg, num_microbatches=cfg.train.global_batch_size // cfg.train.micro_batch_size))
    batches = data.train_steps()
    out = []
    for _ in range(steps):
        c = step_counts(next(batches), cfg.model, data.tokenizer.pad_id)
        out.append({"tokens": c.tokens, "images": c.images, "patches": c.patches, "vision_flops": c.vision_flops,
                    "flops": c.flops})  # fmt: skip
    return out


def run_hf(args, mode: str, overrides: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--worker", "hf", "--hf-mode", mode, "--overrides", json.dumps(overrides),
           f"--steps={args.steps}", f"--hf-batch-size={args.hf_batch_size}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"hf run ({mode}) failed ({proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


SAME_DATA = ("tokens", "images", "samples", "digest")  # per step, each stack's own count; must agree


@dataclass
class Row:
    name: str
    step_times: list[float]
    peak_gib: float
    counts: list[dict]  # per step, counted by this stack itself (SAME_DATA)


def table(rows: list[Row], counts: list[dict], warmup: int) -> list[str]:
    """tokens/s and images/s of each stack from its own counts, MFU from the FLOPs of the (checked
    identical) samples, over the steps after warm-up (totals / total time: packs differ in size
    from step to step), and the median step time."""
    flops = sum(c["flops"] for c in counts[warmup:])
    lines = [
        f"{'stack':<40} {'step s (med)':>12} {'tokens/s':>10} {'images/s':>9} {'MFU':>6} {'peak GiB':>9}"
    ]
    for r in rows:
        t = sum(r.step_times[warmup:])
        tokens, images = (sum(c[k] for c in r.counts[warmup:]) for k in ("tokens", "images"))
        lines.append(f"{r.name:<40} {statistics.median(r.step_times[warmup:]):12.3f} {tokens / t:10,.0f} "
                     f"{images / t:9.1f} {flops / t / PEAK_BF16:6.3f} {r.peak_gib:9.1f}")  # fmt: skip
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-vl-3b", help="a VLM of the zoo (Qwen2.5-VL ViT + Qwen2 LLM)")
    p.add_argument("--text-layers", type=int, default=18, help="LLM layers (Qwen2.5-VL-3B has 36)")
    p.add_argument("--vision-layers", type=int, default=32, help="ViT layers (32 in every Qwen2.5-VL)")
    p.add_argument(
        "--image-size", type=int, default=448, help="images are resized to this square (multiple of 28)"
    )
    p.add_argument("--images-per-sample", type=int, default=4)
    p.add_argument("--samples-per-step", type=int, default=6, help="train.global_batch_size (samples)")
    p.add_argument("--num-samples", type=int, default=64, help="distinct samples written (the stream cycles)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", default="bf16", help="Loong's train.dtype (fp32 for a CPU smoke run)")
    p.add_argument(
        "--hf-modes",
        nargs="*",
        default=["amp"],
        choices=["amp", "bf16"],
        help="amp: fp32 weights + bf16 autocast (Loong's numerics); bf16: bf16 weights and optimizer",
    )
    p.add_argument("--model-overrides", nargs="*", default=[], help="model.* overrides for both stacks")
    p.add_argument("--hf-batch-size", type=int, default=3,
                   help="samples per HF micro-batch (padded to its longest sample, as an HF user batches)")
    p.add_argument("--skip-loong", action="store_true")
    p.add_argument("--text-only", action="store_true",
                   help="also run Loong on text-only packs of the same length (the same LLM, no images): "
                        "LLM tokens/s of the vision-heavy mix / text-only (issue target >= 0.85)")
    p.add_argument("--loong-extra", nargs="*", default=[], help="extra overrides for the Loong run")
    p.add_argument("--variants", nargs="*", default=["base="],
                   help="label=override,override ...: one Loong run per variant (on top of --loong-extra)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each variant, alternated (A B A B)")
    p.add_argument("--worker", choices=["hf"], help=argparse.SUPPRESS)
    p.add_argument("--hf-mode", default="amp", help=argparse.SUPPRESS)
    p.add_argument("--overrides", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "hf":
        return hf_worker(args)
    if args.image_size % 28:
        raise SystemExit(f"--image-size {args.image_size} must be a multiple of 28 (patch 14 x merge 2)")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        jsonl = write_bench_data(work / "data", image_size=args.image_size, images_per_sample=args.images_per_sample,
                                 num_samples=args.num_samples)  # fmt: skip
        overrides = train_overrides(args, jsonl, work)
        rows = []
        if not args.skip_loong:  # first: it converts the data into the shared cache
            rows = loong_rows(args, overrides, work)
        hf = {}
        for mode in args.hf_modes:
            hf = run_hf(args, mode, overrides)
            rows.append(Row(f"hf transformers ({mode}, sdpa, batches of {args.hf_batch_size})", hf["step_times"],
                            hf["peak_gib"], [{k: c[k] for k in SAME_DATA} for c in hf["counts"]]))  # fmt: skip
        text = run_loong_text_only(args, work / "text") if args.text_only else None
        check_same_data(rows)  # the same samples, tokens, images and digest, step by step
        c = rows[-1].counts
        print(f"same data in all {len(rows)} runs: {sum(x['samples'] for x in c)} samples, "
              f"{sum(x['tokens'] for x in c):,} tokens, {sum(x['images'] for x in c)} images, equal digests")
        cfg = compose(overrides)
        counts = hf["counts"] if hf else data_counts(cfg, args.steps)  # the step FLOPs of the (same) packs
    import torch

    shape = bench_shape(cfg.model)
    kept = counts[args.warmup :]
    n_llm = shape.text.num_parameters()
    n_vis = cfg.model.num_parameters() - cfg.model.foundation.num_parameters()  # encoder + projector
    print(f"\n{args.model} with {args.text_layers} LLM / {args.vision_layers} ViT layers: {(n_llm + n_vis) / 1e9:.3f}B "
          f"params ({n_llm / 1e9:.3f}B LLM + {n_vis / 1e9:.3f}B vision; HF built {hf.get('params', 0) / 1e9:.3f}B), "
          f"seq {args.seq}, {args.samples_per_step} samples/step x {args.images_per_sample} images of "
          f"{args.image_size}x{args.image_size}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")  # fmt: skip
    print(f"per step (mean after warm-up): {statistics.mean(c['tokens'] for c in kept):,.0f} tokens, "
          f"{statistics.mean(c['images'] for c in kept):.1f} images, {statistics.mean(c['patches'] for c in kept):,.0f} "
          f"ViT patches; vision share of the FLOPs {sum(c['vision_flops'] for c in kept) / sum(c['flops'] for c in kept):.1%}; "
          f"{args.steps - args.warmup} steps after {args.warmup} warm-up")  # fmt: skip
    print("\n".join(table(rows, counts, args.warmup)))
    if not args.skip_loong:
        print("\n".join(variant_summary(rows, args.warmup)))
    hf_rows = [r for r in rows if r.name.startswith("hf ")]
    for r in (rows if hf_rows and not args.skip_loong else []):
        if not r.name.startswith("hf "):
            loong_t, hf_t = sum(r.step_times[args.warmup :]), sum(hf_rows[0].step_times[args.warmup :])
            print(f"{r.name} / {hf_rows[0].name}: {hf_t / loong_t:.3f}x tokens/s")
    if text is not None:
        print(f"\nloong text-only (same LLM, text packs of seq {args.seq}, {text['tokens_per_step']:,.0f} tokens/step): "
              f"{text['tokens_per_s']:,.0f} tokens/s, MFU {text['mfu']:.3f}, peak {text['peak_gib']:.1f} GiB")
        if not args.skip_loong:
            mm = rows[0]  # the first variant's first run
            vlm = sum(c["tokens"] for c in mm.counts[args.warmup :]) / sum(mm.step_times[args.warmup :])
            ratio = vlm / text["tokens_per_s"]
            print(f"LLM tokens/s, vision-heavy mix / text-only: {ratio:.3f}x (target >= 0.85)")
            print(ceiling_line(ratio, text_only_ceiling(kept, text["counts"])))
    elif not args.skip_loong:
        share = sum(c["vision_flops"] for c in kept) / sum(c["flops"] for c in kept)
        print(f"\nceiling of the text-only ratio at equal MFU ~ the LLM's share of the mix's FLOPs: {1 - share:.3f}x "
              f"(--text-only measures it on text packs)")


def ceiling_line(ratio: float, ceiling: float) -> str:
    """How far the measured ratio is from the one reachable at equal MFU (both stacks' FLOPs by
    vlm_flops: the mix's image tokens also pay the ViT over their patches)."""
    return (f"ceiling at equal MFU (text-only FLOPs per token / vision-mix FLOPs per token): {ceiling:.3f}x; "
            f"measured {ratio:.3f}x = {ratio / ceiling:.1%} of it (the ratio of the two runs' MFUs); "
            f"0.85x would need the mix at {0.85 / ceiling:.2f}x the text-only MFU")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
