"""ImageSpec(crop=None, max_size=...) keeps the aspect ratio; pad_to_square pads like LLaVA."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

import mmcache as mc
from mmcache.errors import ConfigError
from mmcache.transforms.image import PAD_FILL
from mmcache.transforms.pixels import resized_size

# (width, height) -> the [H, W] ImageSpec(size=64, crop=None, max_size=160) must give
SHAPES = {
    (640, 480): (64, 85),  # shorter side 64, longer int(64 * 640 / 480)
    (300, 500): (106, 64),
    (97, 97): (64, 64),
    (1200, 300): (40, 160),  # 256 px long side capped at 160: short int(160 * 64 / 256)
    (48, 30): (64, 102),  # upscaled
}


def _noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _dataset(
    tmp_path: Path, images: dict[str, Image.Image], spec: mc.ImageSpec
) -> mc.MultimodalDataset:
    lines = []
    for name, im in images.items():
        path = tmp_path / f"{name}.png"
        im.save(path)
        lines.append(json.dumps({"id": name, "image_path": str(path), "caption": "a photo"}))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return mc.MultimodalDataset(manifest, pipeline=mc.Pipeline(image=spec))


def test_crop_none_keeps_the_aspect_ratio_with_max_size(tmp_path: Path) -> None:
    spec = mc.ImageSpec(size=64, crop=None, max_size=160, draft=False)
    assert spec.resize == 64  # no crop: the shorter side goes to size by default
    images = {f"{w}x{h}": _noise(w, h, i) for i, (w, h) in enumerate(SHAPES)}
    ds = _dataset(tmp_path, images, spec)
    for i, ((w, h), (out_h, out_w)) in enumerate(SHAPES.items()):
        item = ds[i]
        assert item is not None
        assert tuple(item["image"].shape) == (3, out_h, out_w), (w, h)
        assert tuple(ds.produce(i)["image"].shape) == (3, out_h, out_w)
        # the pixels are a plain resize of the whole image (nothing cropped away)
        want = images[f"{w}x{h}"].resize((out_w, out_h), Image.Resampling.BICUBIC)
        assert np.array_equal(item["image"].numpy().transpose(1, 2, 0), np.asarray(want))
    # without max_size the panorama is not capped
    uncapped = mc.ImageSpec(size=64, crop=None)
    assert uncapped(_noise(1200, 300)).shape == (3, 64, 256)
    # an explicit resize is the shorter side
    assert mc.ImageSpec(crop=None, resize=48)(_noise(640, 480)).shape == (3, 48, 64)


def test_resized_size_is_torchvisions_formula() -> None:
    assert resized_size(640, 480, 256, None) == (341, 256)
    assert resized_size(480, 640, 256, None) == (256, 341)
    assert resized_size(1000, 100, 256, 512) == (512, 51)
    assert resized_size(100, 1000, 256, 512) == (51, 512)
    assert resized_size(300, 300, 256, 512) == (256, 256)


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_crop_none_honours_exif_orientation(tmp_path: Path, orientation: int) -> None:
    im = _noise(120, 60, seed=orientation)
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / "a.jpg"
    im.save(path, quality=95, exif=exif)
    spec = mc.ImageSpec(size=32, crop=None, draft=False)
    out = mc.Pipeline(image=spec).load_image(path, sample_id="a")
    with Image.open(path) as f:
        upright = ImageOps.exif_transpose(f).convert("RGB")
    nw, nh = resized_size(upright.width, upright.height, 32, None)
    assert out.shape == (3, nh, nw)
    want = np.asarray(upright.resize((nw, nh), Image.Resampling.BICUBIC))
    # resampled in the stored frame, then transposed: equal up to fixed-point rounding
    assert np.abs(out.transpose(1, 2, 0).astype(int) - want).max() <= 2


def test_crop_none_with_a_reduced_jpeg_decode(tmp_path: Path) -> None:
    path = tmp_path / "big.jpg"
    _noise(1600, 1000).resize((1600, 1000)).save(path, quality=90)
    spec = mc.ImageSpec(size=100, crop=None)
    assert spec.draft_size(1600, 1000) == (100, 100)
    out = mc.Pipeline(image=spec).load_image(path, sample_id="a")
    assert out.shape == (3, 100, 160)


def _expand2square(im: Image.Image, fill: tuple[int, int, int]) -> Image.Image:
    """LLaVA's expand2square, verbatim."""
    width, height = im.size
    if width == height:
        return im
    if width > height:
        result = Image.new(im.mode, (width, width), fill)
        result.paste(im, (0, (width - height) // 2))
        return result
    result = Image.new(im.mode, (height, height), fill)
    result.paste(im, ((height - width) // 2, 0))
    return result


@pytest.mark.parametrize("fill", [None, (0, 255, 0)])
def test_pad_to_square_pads_with_the_fill_colour(
    tmp_path: Path, fill: tuple[int, int, int]
) -> None:
    assert PAD_FILL == (122, 116, 104)  # int(CLIP mean * 255): LLaVA's padding colour
    colour = PAD_FILL if fill is None else fill
    red = Image.new("RGB", (120, 40), (255, 0, 0))
    spec = mc.ImageSpec(size=60, resize=60, pad_to_square=True, fill=fill, draft=False)
    ds = _dataset(tmp_path, {"wide": red, "tall": red.transpose(Image.Transpose.ROTATE_90)}, spec)
    for i in range(2):
        out = ds.produce(i)["image"].transpose(1, 2, 0)
        assert out.shape == (60, 60, 3)
        bands = [out[:15], out[-15:]] if i == 0 else [out[:, :15], out[:, -15:]]
        for band in bands:  # 40 of 120 rows are padding: 20 px of the 60 on each side
            assert (band == colour).all()
        assert tuple(out[30, 30]) == (255, 0, 0)
    # equal to LLaVA's expand2square + resize of the same image
    photo = _noise(90, 50)
    want = np.asarray(_expand2square(photo, colour).resize((60, 60), Image.Resampling.BICUBIC))
    got = spec(photo).transpose(1, 2, 0)
    assert np.array_equal(got, want)
    # with crop=None the square stays whole at any size
    assert mc.ImageSpec(size=48, crop=None, pad_to_square=True)(photo).shape == (3, 48, 48)


def test_new_options_enter_the_fingerprint_only_when_set() -> None:
    default = mc.ImageSpec()
    explicit = mc.ImageSpec(crop="center", max_size=None, pad_to_square=False, fill=None)
    assert explicit.fingerprint() == default.fingerprint()
    assert explicit.fingerprint_fields() == default.fingerprint_fields()
    assert "max_size" not in default.fingerprint_fields()
    assert "pad_to_square" not in default.fingerprint_fields()
    digests = {
        default.fingerprint(),
        mc.ImageSpec(crop=None).fingerprint(),
        mc.ImageSpec(crop=None, resize=256).fingerprint(),
        mc.ImageSpec(crop=None, max_size=512).fingerprint(),
        mc.ImageSpec(pad_to_square=True).fingerprint(),
        mc.ImageSpec(pad_to_square=True, fill=(0, 0, 0)).fingerprint(),
        mc.ImageSpec(crop=None, pad_to_square=True).fingerprint(),
    }
    assert len(digests) == 7
    assert mc.ImageSpec(pad_to_square=True, fill=PAD_FILL) == mc.ImageSpec(pad_to_square=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"crop": "random"}, "crop must be 'center' or None"),
        ({"max_size": 300}, "applies only with crop=None"),
        ({"crop": None, "size": 256, "max_size": 256}, r"must be > resize \(256\)"),
        ({"fill": (1, 2, 3)}, "pass pad_to_square=True"),
        ({"pad_to_square": True, "fill": (1, 2)}, "3 ints 0..255"),
        ({"pad_to_square": True, "fill": (1, 2, 300)}, "3 ints 0..255"),
        ({"pad_to_square": 1}, "pad_to_square must be a bool"),
    ],
)
def test_bad_options_are_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        mc.ImageSpec(**kwargs)  # type: ignore[arg-type]
