"""``mmcache.augment.from_torchvision`` against open_clip's own transforms and torchvision.

- the crop boxes drawn after the cache (area covered, aspect) have the distribution of
  open_clip's ``preprocess_train`` on the original image: 2,000 draws each, two-sample
  Kolmogorov-Smirnov test, p > 0.01 (and the statistic under 0.05);
- the pixels of one box, cropped from the cached image, are within one level of 255
  (mean absolute difference) of torchvision's crop of the original;
- the eval transform (Resize 224 + CenterCrop 224) gives open_clip's ``preprocess_val``
  tensor; colour jitter and greyscale give torchvision's for the same draws;
- what cannot be split is a ConfigError naming the transform.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from refenv import need

open_clip_transform = need("open_clip.transform")
tv = need("torchvision.transforms")
tvF = need("torchvision.transforms.functional")
v2 = need("torchvision.transforms.v2")
stats = need("scipy.stats")

from mmcache.augment import (  # noqa: E402
    ColorJitter,
    RandomGrayscale,
    RandomResizedCrop,
    from_torchvision,
    sample_generators,
)
from mmcache.errors import ConfigError  # noqa: E402
from mmcache.transforms.image import ImageSpec  # noqa: E402

DRAWS = 2000


def photo(width: int, height: int) -> Image.Image:
    """matplotlib's Grace Hopper photograph (a real JPEG shipped with the package),
    resized to ``width x height``."""
    import matplotlib.cbook

    with Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg")) as im:
        return im.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)


class _Drawn(Exception):
    """Stops open_clip's pipeline once its crop box is drawn (the resize after it would
    only cost time: 2,000 bicubic resizes take minutes on a loaded 2-core machine)."""


def open_clip_boxes(preprocess: object, image: Image.Image, n: int) -> np.ndarray:
    """``(top, left, h, w)`` of the crops open_clip's ``preprocess_train`` takes on ``n``
    calls: its RandomResizedCrop's ``get_params``, recorded as the pipeline calls it."""
    crop = preprocess.transforms[0]  # type: ignore[attr-defined]
    assert type(crop).__name__ == "RandomResizedCrop"
    boxes: list[tuple[int, int, int, int]] = []
    original = crop.get_params

    def spy(img: object, scale: object, ratio: object) -> tuple[int, int, int, int]:
        box = original(img, scale, ratio)
        boxes.append(tuple(int(v) for v in box))  # type: ignore[arg-type]
        raise _Drawn

    crop.get_params = spy
    torch.manual_seed(1234)
    try:
        for _ in range(n):
            with pytest.raises(_Drawn):
                preprocess(image)  # type: ignore[operator]
    finally:
        del crop.get_params
    return np.array(boxes, dtype=np.float64)


def mmcache_boxes(crop: RandomResizedCrop, height: int, width: int, n: int) -> np.ndarray:
    gens = sample_generators(seed=0, epoch=0, indices=range(n))
    return np.array([crop.params(height, width, g) for g in gens], dtype=np.float64)


def area_aspect(
    boxes: np.ndarray, height: int, width: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """The area covered (a fraction of the image's) and the aspect (w / h) of each box,
    its sides dequantised by a uniform +-0.5 px (each grid rounds the same continuous
    draws to its own pixels: without it a 273 px grid and a 600 px one differ in their
    steps, not in their distribution)."""
    rng = np.random.default_rng(seed)
    h = boxes[:, 2] + rng.uniform(-0.5, 0.5, len(boxes))
    w = boxes[:, 3] + rng.uniform(-0.5, 0.5, len(boxes))
    return h * w / (height * width), w / h


#: The stated tolerance: the two-sample Kolmogorov-Smirnov statistic (the largest gap
#: between the two empirical CDFs) of 2,000 draws each. Measured 0.026-0.057 on the
#: sizes below; the old README recipe (a cached 256 centre crop) gives 1.0.
MAX_KS = 0.07


@pytest.mark.parametrize(
    "size", [(640, 480), (480, 600), (1000, 300)], ids=["4:3", "4:5", "panorama"]
)
def test_crop_boxes_have_open_clip_distribution(size: tuple[int, int]) -> None:
    width, height = size
    preprocess = open_clip_transform.image_transform(224, is_train=True)
    stage, augment = from_torchvision(preprocess)
    image = photo(width, height)
    cached = stage(image)  # what the cache holds: the whole image, shorter side 273
    ch, cw = cached.shape[-3:-1] if stage.channels_last else cached.shape[1:]
    assert min(ch, cw) == 273 and abs(cw / ch - width / height) < 0.01
    crop = augment.transforms[0]
    assert isinstance(crop, RandomResizedCrop) and crop.interpolation == "bicubic"
    boxes = open_clip_boxes(preprocess, image, DRAWS)
    ref_area, ref_aspect = area_aspect(boxes, height, width, seed=0)
    got_area, got_aspect = area_aspect(mmcache_boxes(crop, ch, cw, DRAWS), ch, cw, seed=1)
    for name, ref, got in (("area", ref_area, got_area), ("aspect", ref_aspect, got_aspect)):
        result = stats.ks_2samp(ref, got)
        assert result.statistic <= MAX_KS, (name, result)
        assert abs(np.median(ref) - np.median(got)) < 0.01, name
    # The test's power: the old README recipe (a 256 centre crop of a 293 resize cached,
    # then RandomResizedCrop(224, scale=(0.9, 1.0))) covers ~55% of a 4:3 photo.
    old = ImageSpec(size=256)
    short = min(width, height)
    old_area = area_aspect(mmcache_boxes(crop, 256, 256, DRAWS), 256, 256, seed=1)[0] * (
        (256 * short) ** 2 / (old.resize_to**2 * width * height)
    )
    assert stats.ks_2samp(ref_area, old_area).statistic > 0.9


def test_same_box_pixels_within_one_level_of_torchvision() -> None:
    # 546 x 728 caches at exactly half (273 x 364): a box on the cached image is the
    # box of twice its coordinates on the original, with no rounding.
    preprocess = open_clip_transform.image_transform(224, is_train=True)
    stage, augment = from_torchvision(preprocess)
    image = photo(546, 728)
    cached = torch.from_numpy(stage(image)).permute(2, 0, 1)  # channels_last: [H,W,3]
    assert tuple(cached.shape) == (3, 364, 273)
    crop = augment.transforms[0]
    diffs = []
    for g in sample_generators(seed=3, epoch=0, indices=range(24)):
        state = g.get_state()
        top, left, h, w = crop.params(364, 273, g)
        g.set_state(state)
        ours = crop(cached.unsqueeze(0).contiguous(memory_format=torch.channels_last), [g])[0]
        theirs = tvF.resized_crop(
            image, 2 * top, 2 * left, 2 * h, 2 * w, [224, 224], tv.InterpolationMode.BICUBIC
        )
        ref = torch.from_numpy(np.array(theirs)).permute(2, 0, 1)
        diffs.append((ours.int() - ref.int()).abs().float().mean().item())
    # Measured: 0.70-0.80 levels per box (two resamplings against torchvision's one).
    assert max(diffs) <= 1.0, diffs


def test_eval_transform_equals_preprocess_val() -> None:
    preprocess = open_clip_transform.image_transform(224, is_train=False)
    stage, augment = from_torchvision(preprocess)
    assert (stage.size, stage.resize, stage.crop, stage.interpolation) == (
        224,
        224,
        "center",
        "bicubic",
    )
    for size in [(640, 480), (480, 800), (333, 517)]:
        image = photo(*size)
        cached = torch.from_numpy(stage(image)).permute(2, 0, 1).unsqueeze(0)
        ours = augment(cached, sample_generators(0, 0, [0]))[0]
        ref = preprocess(image)
        # Normalised by CLIP's std (~0.27): one level of 255 is ~0.015.
        level = (ours - ref).abs() * torch.tensor(preprocess.transforms[-1].std).view(3, 1, 1)
        assert level.mean().item() * 255 <= 0.5 and level.max().item() * 255 <= 3.01, size


def test_aug_cfg_colour_and_greyscale_are_split() -> None:
    cfg = open_clip_transform.AugmentationCfg(
        color_jitter=(0.4, 0.4, 0.4, 0.1), color_jitter_prob=0.8, gray_scale_prob=0.2
    )
    with pytest.warns(UserWarning):  # open_clip's own note on the unused cfg keys
        preprocess = open_clip_transform.image_transform(224, is_train=True, aug_cfg=cfg)
    _, augment = from_torchvision(preprocess)
    jitter, grey = augment.transforms[1], augment.transforms[2]
    assert isinstance(jitter, ColorJitter) and jitter.p == 0.8
    assert jitter.brightness == (0.6, 1.4) and jitter.hue == (-0.1, 0.1)
    assert isinstance(grey, RandomGrayscale) and grey.p == 0.2


def test_color_jitter_equals_torchvision_for_the_same_draws() -> None:
    image = torch.from_numpy(np.array(photo(96, 72))).permute(2, 0, 1).contiguous()
    ref_jitter = tv.ColorJitter(0.4, 0.4, 0.4, 0.1)
    ours = ColorJitter(0.4, 0.4, 0.4, 0.1)
    worst = 0
    for seed in range(20):
        torch.manual_seed(seed)
        ref = ref_jitter(image)  # torchvision's tensor kernels, its global RNG
        g = torch.Generator().manual_seed(seed)  # the same draws from our generator
        got = ours(image.unsqueeze(0), [g])[0]
        worst = max(worst, int((got.int() - ref.int()).abs().max()))
    assert worst <= 1


def test_grayscale_and_v2_compose() -> None:
    image = torch.from_numpy(np.array(photo(64, 48))).permute(2, 0, 1).contiguous()
    grey = RandomGrayscale(1.0)(image.unsqueeze(0), sample_generators(0, 0, [0]))[0]
    assert torch.equal(grey, tvF.rgb_to_grayscale(image, num_output_channels=3))
    t = v2.Compose(
        [
            v2.RandomResizedCrop(224, scale=(0.5, 1.0), antialias=True),
            v2.RandomHorizontalFlip(),
            v2.RandomApply([v2.ColorJitter(0.2, 0.2)], p=0.5),
            v2.RandomGrayscale(0.1),
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize([0.5] * 3, [0.5] * 3),
        ]
    )
    stage, augment = from_torchvision(t)
    assert stage.crop is None
    assert [type(a).__name__ for a in augment.transforms] == [
        "RandomResizedCrop",
        "RandomHorizontalFlip",
        "ColorJitter",
        "RandomGrayscale",
        "Normalize",
    ]
    out = augment(torch.zeros(2, 3, 300, 400, dtype=torch.uint8), sample_generators(0, 0, [0, 1]))
    assert out.dtype == torch.float32 and tuple(out.shape) == (2, 3, 224, 224)


@pytest.mark.parametrize(
    ("transform", "named"),
    [
        (lambda: tv.Compose([tv.Lambda(lambda x: x), tv.ToTensor()]), "Lambda"),
        (lambda: tv.Compose([tv.Resize((224, 224)), tv.ToTensor()]), "squashes"),
        (lambda: tv.Compose([tv.RandomResizedCrop(224), tv.Resize(200)]), "Resize"),
        (
            lambda: open_clip_transform.image_transform(224, False, resize_mode="longest"),
            "ResizeKeepRatio",
        ),
        (lambda: tv.Compose([tv.RandomRotation(10)]), "RandomRotation"),
    ],
    ids=["lambda", "squash", "resize-after-crop", "open_clip-longest", "rotation"],
)
def test_unsplittable_is_a_config_error_naming_the_transform(transform, named: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=named):
        from_torchvision(transform())


def test_eval_transform_equals_preprocess_val_on_files_as_open_clip_loads_them(
    tmp_path: object,
) -> None:
    """The R1 newcomer's cases (issue 42), from files as open_clip's datasets open them
    (``Image.open(path)``, no EXIF transpose): an upscaled portrait photo (171 x 232:
    9 levels off before, the crop box resampled alone) and a photo stored sideways with
    EXIF orientation 6 (58 levels: it was turned upright). Now the cached pixels are
    torchvision's to the bit; what differs is the float rounding of the normalisation."""
    from pathlib import Path

    from mmcache.transforms.image import load_image

    folder = Path(str(tmp_path))
    preprocess = open_clip_transform.image_transform(224, is_train=False)
    stage, augment = from_torchvision(preprocess)
    assert stage.exif_transpose is False
    exif = Image.Exif()
    exif[0x0112] = 6
    files = []
    for k, (size, tags) in enumerate([((171, 232), None), ((320, 200), exif), ((150, 460), None)]):
        path = folder / f"{k}.jpg"
        photo(*size).save(path, "JPEG", quality=92, **({"exif": tags.tobytes()} if tags else {}))
        files.append(path)
    for path in files:
        cached = torch.from_numpy(load_image(stage, path, sample_id="p"))
        ours = augment(cached.permute(2, 0, 1).unsqueeze(0), sample_generators(0, 0, [0]))[0]
        with Image.open(path) as im:
            ref = preprocess(im)
        level = (ours - ref).abs() * torch.tensor(preprocess.transforms[-1].std).view(3, 1, 1)
        assert level.max().item() * 255 <= 0.01, (path.name, level.max().item() * 255)
