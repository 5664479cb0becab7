"""Build the bundled multimodal sample (``loong_data/corpus/vlm_sample``) from real, licensed sources.

    uv run --with scikit-image --with scikit-learn \\
        python -m loong_data.tools.build_vlm_sample --out packages/loong-data/src/loong_data/corpus/vlm_sample

No captioned / QA image dataset installs offline, so this derives a small one from labelled
sources that do (see ATTRIBUTION.md, written next to the data):

- 17 scikit-image sample photographs: the caption is the first line of the loader's docstring
  (written by the scikit-image authors); colour/grayscale answers come from the pixel data.
- 200 scikit-learn ``load_digits`` images (UCI, CC BY 4.0) with their labels.
- The bundled Shakespeare texts for text-only questions (which play is this passage from?).
- Six tiny "videos" that are NOT real recordings: sequences of crops sliding over one photograph
  (a synthetic camera pan), the direction of motion being the answer.

scikit-image and scikit-learn are needed only to run this script, not at run time. The output is
deterministic (fixed seed, sorted inputs, PIL encoders with fixed settings).
"""

import argparse
import json
import random
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from loong_data.bundled import default_corpus

SEED = 1234
PHOTO_MAX_SIDE = 256
JPEG_QUALITY = 85
DIGIT_SCALE = 4  # 8x8 digits saved as 32x32 (nearest), so they are visible; content unchanged
NUM_DIGITS = 200
NUM_DIGIT_SEQUENCES = 40
NUM_TEXT = 30
VIDEO_FRAMES = 8
VIDEO_SIDE = 96

# scikit-image loaders used, with the license stated in each loader's docstring (checked by hand).
SKIMAGE_PHOTOS = {
    "astronaut": "public domain (NASA; no known copyright restrictions)",
    "brick": "CC0 (CC0Textures)",
    "camera": "CC0 (photographer Lav Varshney)",
    "chelsea": "CC0 (photographer Stefan van der Walt)",
    "cell": "CC0",
    "clock": "public domain (photographer Stefan van der Walt)",
    "coffee": "CC0 (photographer Rachel Michetti, courtesy of Pikolo Espresso Bar)",
    "coins": "no known copyright restrictions (Brooklyn Museum open collection)",
    "grass": "CC0 (DeviantArt, linolafett)",
    "gravel": "CC0 (CC0Textures)",
    "horse": "CC0 (openclipart, Andreas Preuss)",
    "hubble_deep_field": "public domain (NASA)",
    "immunohistochemistry": "no known copyright restrictions",
    "microaneurysms": "CC0 (Andreas Maier)",
    "retina": "CC0 1.0 (Wikimedia Commons, Häggström)",
    "rocket": "public domain (SpaceX)",
    "text": "public domain (Wikimedia Commons)",
}
VIDEO_SOURCES = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "coins")
CAPTION_PROMPTS = (
    "Describe this image.",
    "What does this image show?",
    "Write a short caption for this image.",
)


def _user(*content: dict) -> dict:
    return {"role": "user", "content": list(content)}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _image(path: str) -> dict:
    return {"type": "image", "image": path}


def _to_uint8(array: np.ndarray) -> np.ndarray:
    if array.dtype == bool:
        return array.astype(np.uint8) * 255
    if array.dtype != np.uint8:
        array = np.asarray(array, dtype=np.float64)
        array = (255 * (array - array.min()) / max(array.max() - array.min(), 1e-12)).round()
    return array.astype(np.uint8)


def _photo(array: np.ndarray) -> Image.Image:
    image = Image.fromarray(_to_uint8(array))
    image = image.convert("RGB") if image.mode not in ("L", "RGB") else image
    image.thumbnail((PHOTO_MAX_SIDE, PHOTO_MAX_SIDE), Image.Resampling.LANCZOS)
    return image


def _is_colour(array: np.ndarray) -> bool:
    return array.ndim == 3 and not (
        np.array_equal(array[..., 0], array[..., 1]) and np.array_equal(array[..., 1], array[..., 2])
    )


def _save_jpeg(image: Image.Image, path: Path) -> None:
    image.save(path, format="JPEG", quality=JPEG_QUALITY, optimize=False, progressive=False)


def _photos(out: Path, records: list[dict], rng: random.Random) -> dict[str, tuple[Image.Image, str]]:
    import skimage.data

    (out / "images").mkdir()
    photos = {}
    for name in SKIMAGE_PHOTOS:
        loader = getattr(skimage.data, name)
        array = loader()
        caption = loader.__doc__.strip().splitlines()[0].strip()
        image = _photo(array)
        rel = f"images/{name}.jpg"
        _save_jpeg(image, out / rel)
        photos[name] = (image, caption)
        records.append(
            {
                "id": f"caption-{name}",
                "messages": [_user(_image(rel), _text(rng.choice(CAPTION_PROMPTS))), _assistant(caption)],
            }
        )
        kind = "a colour" if _is_colour(array) else "a grayscale"
        records.append(
            {
                "id": f"colour-{name}",
                "messages": [
                    _user(_image(rel), _text("Is this a colour or a grayscale image?")),
                    _assistant(f"It is {kind} image."),
                ],
            }
        )
    # Two-image questions: which of the two shows a given caption.
    names = sorted(photos)
    for i in range(10):
        a, b = rng.sample(names, 2)
        target = rng.choice((a, b))
        answer = "The first image." if target == a else "The second image."
        records.append(
            {
                "id": f"which-{i:02d}",
                "messages": [
                    _user(
                        _image(f"images/{a}.jpg"),
                        _image(f"images/{b}.jpg"),
                        _text(f"Which of the two images shows this: {photos[target][1]}"),
                    ),
                    _assistant(answer),
                ],
            }
        )
    return photos


def _digits(out: Path, records: list[dict], rng: random.Random) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    (out / "digits").mkdir()
    chosen = sorted(rng.sample(range(len(digits.target)), NUM_DIGITS))
    paths = []
    for index in chosen:
        # Values 0..16 (ink) -> white background, dark ink, as the digit was written.
        pixels = (255 - np.round(digits.images[index] * 255 / 16)).astype(np.uint8)
        image = Image.fromarray(pixels).resize((8 * DIGIT_SCALE, 8 * DIGIT_SCALE), Image.Resampling.NEAREST)
        rel = f"digits/{index:04d}.png"
        image.save(out / rel, format="PNG", optimize=False)
        label = int(digits.target[index])
        paths.append((rel, label))
        records.append(
            {
                "id": f"digit-{index:04d}",
                "messages": [_user(_image(rel), _text("What digit is this?")), _assistant(str(label))],
            }
        )
    for i in range(NUM_DIGIT_SEQUENCES):
        picked = rng.sample(paths, rng.choice((2, 3, 4)))
        records.append(
            {
                "id": f"digit-sequence-{i:02d}",
                "messages": [
                    _user(
                        *[_image(rel) for rel, _ in picked],
                        _text("Read the digits in these images, in order."),
                    ),
                    _assistant(" ".join(str(label) for _, label in picked)),
                ],
            }
        )
    # Multi-turn: the second question is about the first answer (text only).
    for i in range(10):
        rel, label = rng.choice(paths)
        records.append(
            {
                "id": f"digit-dialogue-{i:02d}",
                "messages": [
                    {"role": "system", "content": [_text("You read handwritten digits.")]},
                    _user(_image(rel), _text("What digit is this?")),
                    _assistant(str(label)),
                    _user(_text("Is it even or odd?")),
                    _assistant("Even." if label % 2 == 0 else "Odd."),
                ],
            }
        )


def _videos(out: Path, records: list[dict], photos: dict, rng: random.Random) -> None:
    (out / "videos").mkdir()
    directions = ("left to right", "right to left", "top to bottom", "bottom to top")
    for name in VIDEO_SOURCES:
        image = photos[name][0].convert("RGB")
        direction = rng.choice(directions)
        width, height = image.size
        side = min(VIDEO_SIDE, width, height)
        span_x, span_y = width - side, height - side
        folder = f"videos/pan-{name}"
        (out / folder).mkdir()
        for f in range(VIDEO_FRAMES):
            step = f / (VIDEO_FRAMES - 1)
            x = round(span_x * step) if direction == "left to right" else round(span_x * (1 - step))
            y = round(span_y * step) if direction == "top to bottom" else round(span_y * (1 - step))
            if direction in ("left to right", "right to left"):
                y = span_y // 2
            else:
                x = span_x // 2
            _save_jpeg(image.crop((x, y, x + side, y + side)), out / folder / f"{f:03d}.jpg")
        records.append(
            {
                "id": f"video-pan-{name}",
                "messages": [
                    _user(
                        {"type": "video", "video": folder}, _text("In which direction does the view move?")
                    ),
                    _assistant(f"From {direction}."),
                ],
            }
        )
        other = rng.choice([n for n in photos if n != name])
        same = rng.random() < 0.5
        shown = name if same else other
        records.append(
            {
                "id": f"mixed-{name}",
                "messages": [
                    _user(
                        _image(f"images/{shown}.jpg"),
                        {"type": "video", "video": folder},
                        _text("Is the video a pan over the photograph shown first?"),
                    ),
                    _assistant("Yes." if same else "No."),
                ],
            }
        )


def _plays(records: list[dict], rng: random.Random) -> None:
    texts = sorted(default_corpus().glob("*_gut.txt"))
    for i in range(NUM_TEXT):
        path = rng.choice(texts)
        lines = path.read_text(encoding="utf-8").splitlines()
        title = next(line for line in lines if line.strip()).strip()
        # A passage of four consecutive verse lines with text (skip speaker tags / stage directions).
        for _ in range(1000):
            start = rng.randrange(len(lines) // 5, len(lines) - 8)
            passage = lines[start : start + 4]
            if all(len(line.strip()) > 20 and not line.strip().startswith("[") for line in passage):
                break
        records.append(
            {
                "id": f"text-{i:02d}",
                "messages": [
                    _user(_text("Which work of Shakespeare is this passage from?\n\n" + "\n".join(passage))),
                    _assistant(title.title().replace("'S", "'s")),
                ],
            }
        )


ATTRIBUTION = """# Multimodal sample: sources, licenses, attribution

Built by `python -m loong_data.tools.build_vlm_sample` (deterministic). `conversations.jsonl` holds
{num_records} conversations referencing the files in this folder by relative path.

## images/ (scikit-image sample data, scikit-image {skimage_version})

Downscaled (longest side {photo_side} px, JPEG quality {quality}) copies of the images returned by
`skimage.data.<name>()`. Captions are the first line of each loader's docstring. Licenses, as stated in
those docstrings:

{photo_lines}

## digits/ (scikit-learn `load_digits`, scikit-learn {sklearn_version})

{num_digits} of the 1,797 8x8 images of the UCI "Optical Recognition of Handwritten Digits" data set
(E. Alpaydin, C. Kaynak, 1998, <https://doi.org/10.24432/C50P49>), licensed CC BY 4.0
(<https://creativecommons.org/licenses/by/4.0/>). Changes: inverted to dark ink on white and upscaled
4x with nearest-neighbour sampling; file name = index in `load_digits()`. Answers are the data set's labels.

## videos/ (synthetic motion over the photographs above)

These are NOT recordings. Each folder holds {frames} JPEG frames: a {side}x{side} window sliding across
one photograph of images/ (same license as that photograph), i.e. a synthetic camera pan; the answer
(direction of motion) is true by construction.

## Text-only conversations

Passages from the bundled Shakespeare corpus (`loong_data/corpus/shakespeare`, CC BY 2.5, Project
Gutenberg / Open Knowledge Foundation); the answer is the title line of the work.
"""


def build(out: Path) -> int:
    import skimage
    import sklearn

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    rng = random.Random(SEED)
    records: list[dict] = []
    photos = _photos(tmp, records, rng)
    _digits(tmp, records, rng)
    _videos(tmp, records, photos, rng)
    _plays(records, rng)
    with open(tmp / "conversations.jsonl", "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    photo_lines = "\n".join(
        f'- `{name}`: "{photos[name][1]}" - {lic}' for name, lic in SKIMAGE_PHOTOS.items()
    )
    (tmp / "ATTRIBUTION.md").write_text(
        ATTRIBUTION.format(
            num_records=len(records),
            skimage_version=skimage.__version__,
            photo_side=PHOTO_MAX_SIDE,
            quality=JPEG_QUALITY,
            photo_lines=photo_lines,
            sklearn_version=sklearn.__version__,
            num_digits=NUM_DIGITS,
            frames=VIDEO_FRAMES,
            side=VIDEO_SIDE,
        ),
        encoding="utf-8",
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return len(records)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loong_data.tools.build_vlm_sample",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="folder to (re)create")
    args = parser.parse_args(argv)
    n = build(args.out)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"{args.out}: {n} conversations, {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
