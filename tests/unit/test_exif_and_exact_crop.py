"""EXIF per reference and the exact eval crop (issue 42).

- ``exif_transpose``: ``ImageSpec`` / ``SmartResize`` / the HF stages turn a phone photo
  upright (as transformers' ``load_image``) by default, or keep it as stored (False: as
  torchvision's and open_clip's loaders and qwen-vl-utils open it;
  ``from_torchvision`` sets it); the lengths pass sizes images the same way; the
  fingerprint names it only when False.
- ``ImageSpec(draft=False)`` cuts a centre crop from the whole resized image: pixel for
  pixel torchvision's ``Resize`` + ``CenterCrop`` on a PIL image. Before, the crop box
  alone was resampled, which Pillow rounds through another two-pass order: 13-18 levels
  at sharp edges of a portrait image (the R1 newcomer's 9-level upscaled photo).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from chat_support import make_tokenizer
from PIL import Image

import mmcache as mc
from mmcache.transforms.image import load_image
from mmcache.transforms.pixels import resized_size


def _noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _jpeg(path: Path, im: Image.Image, orientation: int | None = None) -> Path:
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    im.save(path, "JPEG", quality=92, exif=exif.tobytes())
    return path


def _stored(path: Path) -> Image.Image:
    """The decoded image as stored: ``Image.open(path).convert("RGB")``."""
    with Image.open(path) as im:
        return im.convert("RGB")


def _torchvision_eval(im: Image.Image, size: int, resize: int) -> np.ndarray:
    """torchvision's ``Resize(resize, BICUBIC)`` + ``CenterCrop(size)`` on a PIL image:
    the shorter side to ``resize``, the whole image resampled, the crop offsets
    ``round((n - size) / 2)``."""
    nw, nh = resized_size(im.width, im.height, resize, None)
    full = im.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = round((nw - size) / 2.0), round((nh - size) / 2.0)
    return np.asarray(full.crop((left, top, left + size, top + size))).transpose(2, 0, 1)


@pytest.mark.parametrize("wh", [(171, 232), (100, 300), (232, 171), (223, 500), (640, 480)])
def test_exact_centre_crop_equals_torchvision_resize_then_crop(
    tmp_path: Path, wh: tuple[int, int]
) -> None:
    path = _jpeg(tmp_path / "p.jpg", _noise(*wh))
    for size, resize in ((224, 224), (224, 256)):
        spec = mc.ImageSpec(size, resize=resize, draft=False, exif_transpose=False)
        got = load_image(spec, path, sample_id="p")
        assert np.array_equal(got, _torchvision_eval(_stored(path), size, resize)), (wh, resize)


def test_exact_centre_crop_of_an_upright_photo(tmp_path: Path) -> None:
    """Upright (the default): the EXIF-turned image is resized whole, then cut."""
    path = _jpeg(tmp_path / "p.jpg", _noise(232, 171), orientation=6)
    got = load_image(mc.ImageSpec(224, resize=224, draft=False), path, sample_id="p")
    upright = _stored(path).transpose(Image.Transpose.ROTATE_270)
    assert np.array_equal(got, _torchvision_eval(upright, 224, 224))


@pytest.mark.parametrize("spec", [
    mc.ImageSpec(64, crop=None), mc.ImageSpec(64), mc.ImageSpec(64, draft=False),
    mc.ImageSpec(64, pad_to_square=True), mc.SmartResize(56 * 56, 28 * 28 * 16),
], ids=["no-crop", "crop", "exact-crop", "square", "smart-resize"])  # fmt: skip
def test_as_stored_equals_the_same_pixels_without_exif(tmp_path: Path, spec: object) -> None:
    pixels = _noise(90, 60, seed=3)
    rotated = _jpeg(tmp_path / "r.jpg", pixels, orientation=6)
    plain = tmp_path / "plain.png"
    _stored(rotated).save(plain)  # the same decoded pixels, no EXIF
    from dataclasses import replace

    stored = replace(spec, exif_transpose=False)  # type: ignore[type-var]
    as_stored = load_image(stored, rotated, sample_id="r")
    assert np.array_equal(as_stored, load_image(spec, plain, sample_id="p"))  # type: ignore[arg-type]
    upright = load_image(spec, rotated, sample_id="r")  # type: ignore[arg-type]
    if getattr(spec, "crop", None) is None or isinstance(spec, mc.SmartResize):
        assert upright.shape[1:] == as_stored.shape[1:][::-1]  # turned: sides swapped
    # in the key only when not the default: existing caches keep theirs
    assert stored.fingerprint() != spec.fingerprint()  # type: ignore[attr-defined]
    assert "exif" not in json.dumps(spec.fingerprint_fields())  # type: ignore[attr-defined]


def test_default_fingerprints_are_unchanged() -> None:
    """The defaults' keys are those of before this option (values from main)."""
    assert mc.ImageSpec(size=224).fingerprint_fields() == {
        "size": 224, "resize": 256, "interpolation": "bicubic", "crop": "center",
        "geometry": "torchvision", "draft": True, "alpha_background": [255, 255, 255],
        "decoder": "pillow", "decoder_major": int(Image.__version__.split(".")[0]),
    }  # fmt: skip
    assert mc.SmartResize().fingerprint_fields()["frame"] == "upright-rgb"


def test_lengths_size_an_as_stored_photo_as_it_is_made(tmp_path: Path) -> None:
    """The length pass reads the header: an as-stored stage must not swap the sides of
    an EXIF-rotated photo (its token count would differ from the sample's)."""
    _jpeg(tmp_path / "r.jpg", _noise(200, 60, seed=5), orientation=6)
    turns = [{"from": "human", "value": "<image>What?"}, {"from": "gpt", "value": "A cat."}]
    records = [{"id": "r", "image": "r.jpg", "conversations": turns}]
    (tmp_path / "m.json").write_text(json.dumps(records), encoding="utf-8")
    tok = make_tokenizer()
    for exif in (True, False):
        stage = mc.SmartResize(56 * 56, 28 * 28 * 16, exif_transpose=exif)
        text = mc.ChatSpec(tok, "chatml", 512, image_tokens=stage.image_tokens)
        pipe = mc.Pipeline(image=stage, text=text)
        ds = mc.MultimodalDataset(tmp_path / "m.json", pipeline=pipe)
        made = ds.produce(0)
        assert ds.lengths().tolist() == [len(made["input_ids"])]
        h, w = made["image_sizes"][0].tolist()
        assert (h < w) == (not exif)  # stored 200x60 (wide), upright 60x200 (tall)
