"""Realistic synthetic image-caption data for the demo, tests and benchmarks.

:func:`make_dataset` writes JPEGs whose sizes and compressed sizes look like COCO's
(sides of 480-640 px, varied aspect ratios, about 40-150 KB at quality 90, mean
about 70 KB) or, with ``large=True``, like web-crawled sources (sides of
1,000-2,000 px), plus a seed-format JSONL manifest with 8-30-word captions.

Why not flat colours or gradients: they compress to ~10 KB and decode several
times faster than photos, which would make every decode-cost figure wrong. Each
image is a smooth random colour field blended with blurred noise (the texture that
keeps JPEG honest) and a few hard-edged shapes, built with a handful of numpy and
Pillow calls (no per-pixel Python): about 3-4 ms per COCO-sized image with its
JPEG encoding.

Deterministic: image ``i`` of seed ``s`` depends only on ``(s, i)``, so the same seed
gives byte-identical files (with the same Pillow/libjpeg build) whatever ``workers``
is, and ``synth_captions(n, s)`` returns exactly the captions of
``make_dataset(..., n, s)``.

>>> import tempfile, json
>>> with tempfile.TemporaryDirectory() as d:
...     manifest = make_dataset(d, 2, seed=0)
...     rows = [json.loads(line) for line in manifest.read_text().splitlines()]
>>> sorted(rows[0])
['caption', 'id', 'image_path']
>>> rows[0]["image_path"]
'images/000000.jpg'
"""

from __future__ import annotations

import io
import json
import os
import pathlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image, ImageDraw

from mmcache.errors import ConfigError
from mmcache.rootfiles import replace_file

__all__ = ["make_dataset", "make_image", "synth_caption", "synth_captions"]

#: Side ranges (px) of the two source kinds.
COCO_SIDES = (480, 640)
LARGE_SIDES = (1000, 2000)

# Stream tags so that images and captions of the same (seed, index) draw from
# independent random streams.
_IMAGE_STREAM = 0
_CAPTION_STREAM = 1

_ADJECTIVES = (
    "small", "large", "old", "young", "bright", "dark", "wooden", "shiny", "busy", "quiet",
    "empty", "crowded", "tall", "short", "striped", "spotted", "fluffy", "wet", "dusty", "modern",
)  # fmt: skip
_COLOURS = (
    "red", "blue", "green", "yellow", "white", "black", "brown", "orange", "grey", "purple",
)  # fmt: skip
_SUBJECTS = (
    "dog", "cat", "man", "woman", "child", "horse", "bird", "bus", "train", "bicycle", "car",
    "boat", "plane", "giraffe", "elephant", "zebra", "person", "skateboarder", "surfer", "cow",
    "sheep", "pizza", "sandwich", "cake", "laptop", "clock", "umbrella", "kite", "vase", "bench",
)  # fmt: skip
_VERBS = (
    "sitting", "standing", "walking", "running", "lying", "riding", "eating", "holding",
    "looking", "waiting", "parked", "flying", "playing", "resting", "crossing",
)  # fmt: skip
_PREPOSITIONS = ("on", "near", "next to", "in front of", "behind", "under", "beside", "across")
_PLACES = (
    "street", "table", "field", "beach", "river", "kitchen", "park", "road", "building",
    "fence", "window", "grass", "snow", "water", "bridge", "city", "market", "station",
)  # fmt: skip
_EXTRAS = (
    "on a sunny day", "at night", "in the rain", "with trees in the background",
    "while people watch", "under a cloudy sky", "in the early morning", "at the end of the day",
    "with a few cars around", "surrounded by other animals", "in a crowded area",
)  # fmt: skip


_MAX_CAPTION_WORDS = 30
_FUNCTION_WORDS = frozenset(
    {"a", "the", "and", "while", "with", "on", "to", "of", "in", "at", "next", "front", "under"}
)


def _phrase(rng: np.random.Generator) -> list[str]:
    words = ["a"]
    if rng.random() < 0.7:
        words.append(str(rng.choice(_ADJECTIVES)))
    if rng.random() < 0.6:
        words.append(str(rng.choice(_COLOURS)))
    words.append(str(rng.choice(_SUBJECTS)))
    words.append(str(rng.choice(_VERBS)))
    words.extend(str(rng.choice(_PREPOSITIONS)).split())
    words.append("the")
    if rng.random() < 0.4:
        words.append(str(rng.choice(_ADJECTIVES)))
    words.append(str(rng.choice(_PLACES)))
    return words


def synth_caption(index: int, seed: int = 0) -> str:
    """Caption ``index`` of ``seed``: 8-30 words, COCO-like, from a small vocabulary."""
    rng = np.random.default_rng((seed, index, _CAPTION_STREAM))
    target = int(rng.integers(8, 31))
    words = _phrase(rng)
    while len(words) < target:
        if rng.random() < 0.5:
            words.extend(str(rng.choice(_EXTRAS)).split())
        else:
            words.append(str(rng.choice(("and", "while", "with"))))
            words.extend(_phrase(rng))
    if len(words) > _MAX_CAPTION_WORDS:
        # Cut mid-phrase: do not end on a function word (at least 25 words remain).
        words = words[:_MAX_CAPTION_WORDS]
        while words[-1] in _FUNCTION_WORDS:
            words.pop()
    return " ".join(words)


def synth_captions(n: int, seed: int = 0) -> list[str]:
    """Captions ``0..n-1`` of ``seed`` (the ones :func:`make_dataset` writes), e.g. to
    train a tokenizer with :func:`mmcache.transforms.text.train_tokenizer`."""
    _check_count(n)
    return [synth_caption(i, seed) for i in range(n)]


def make_image(index: int, seed: int = 0, *, large: bool = False) -> Image.Image:
    """Image ``index`` of ``seed`` as an RGB Pillow image (see the module docstring)."""
    rng = np.random.default_rng((seed, index, _IMAGE_STREAM))
    lo, hi = LARGE_SIDES if large else COCO_SIDES
    width = int(rng.integers(lo, hi + 1))
    # Aspect ratios of about 0.56 to 1.8, like photos (landscape more often).
    aspect = float(np.exp(rng.uniform(-0.45, 0.6)))
    height = int(np.clip(round(width / aspect), lo * 3 // 4, hi))
    if rng.random() < 0.3:
        width, height = height, width
    # Blurred noise: random values on a grid `cell` times coarser than the image,
    # blended with a smooth colour field, then upscaled once. The blend weight sets
    # how much texture (hence JPEG size) each image gets.
    cell = int(rng.integers(2, 5))
    gw, gh = -(-width // cell), -(-height // cell)
    field_shape = (int(rng.integers(2, 6)), int(rng.integers(2, 6)), 3)
    field = Image.fromarray(rng.integers(0, 256, size=field_shape, dtype=np.uint8))
    field = field.resize((gw, gh), Image.Resampling.BICUBIC)
    noise = Image.frombytes("RGB", (gw, gh), rng.bytes(gw * gh * 3))
    base = Image.blend(field, noise, float(rng.uniform(0.12, 0.35)))
    img = base.resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(2, 8))):
        x0, y0 = int(rng.integers(-width // 4, width)), int(rng.integers(-height // 4, height))
        x1 = x0 + int(rng.integers(width // 10, width // 2))
        y1 = y0 + int(rng.integers(height // 10, height // 2))
        colour = (int(rng.integers(256)), int(rng.integers(256)), int(rng.integers(256)))
        kind = rng.random()
        if kind < 0.45:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        elif kind < 0.9:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
        else:
            draw.line((x0, y0, x1, y1), fill=colour, width=int(rng.integers(2, 12)))
    return img


def _check_count(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"n must be an int >= 0, got {n!r}")
    return n


def make_dataset(
    out_dir: str | os.PathLike[str],
    n: int,
    seed: int = 0,
    *,
    large: bool = False,
    quality: int = 90,
    workers: int | None = None,
) -> pathlib.Path:
    """Write ``n`` JPEGs to ``out_dir/images/`` and a manifest; return the manifest's path.

    The manifest ``out_dir/manifest.jsonl`` has one line per image:
    ``{"id": "000123", "image_path": "images/000123.jpg", "caption": "..."}``
    (paths relative to the manifest's folder). Existing files of the same names are
    overwritten.

    Args:
        out_dir: folder to write to (created if missing).
        n: number of samples.
        seed: same seed, same bytes.
        large: 1,000-2,000 px sides instead of COCO-like 480-640 px.
        quality: JPEG quality (1-95).
        workers: threads used to generate and encode (Pillow and numpy release the
            GIL for the heavy parts); ``None``: up to 8, one per CPU. Does not change
            the output.

    Not safe to run twice at once on the same folder.
    """
    _check_count(n)
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 95:
        raise ConfigError(f"quality must be an int in 1..95, got {quality!r}")
    if workers is None:
        workers = min(8, os.cpu_count() or 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be an int >= 1 or None, got {workers!r}")
    root = pathlib.Path(out_dir)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    digits = max(6, len(str(max(n - 1, 0))))

    def write(index: int) -> str:
        name = f"{index:0{digits}d}"
        buf = io.BytesIO()
        make_image(index, seed, large=large).save(buf, "JPEG", quality=quality)
        (images / f"{name}.jpg").write_bytes(buf.getvalue())
        record = {
            "id": name,
            "image_path": f"images/{name}.jpg",
            "caption": synth_caption(index, seed),
        }
        return json.dumps(record, ensure_ascii=False)

    if workers == 1 or n < 2:
        lines = [write(i) for i in range(n)]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            lines = list(pool.map(write, range(n)))
    manifest = root / "manifest.jsonl"
    # Write then rename: a reader never sees a half-written manifest; the temp file has
    # a random name (a shared folder's member cannot plant a link there: rootfiles).
    replace_file(manifest, "".join(line + "\n" for line in lines).encode("utf-8"), 0o644)
    return manifest
