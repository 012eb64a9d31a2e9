"""The colour augments and the final Normalize (issue 26): ColorJitter, RandomGrayscale
(open_clip's aug_cfg color_jitter_prob / gray_scale_prob), bicubic RandomResizedCrop.

Seeded per sample: an image's result depends on (seed, epoch, index) only, never on
the batch it is in, the worker count or a resume. Parity with torchvision's own
kernels is in tests/reference (torchvision is not importable in this venv).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mmcache.augment import (
    BUILTINS,
    ColorJitter,
    Compose,
    Normalize,
    RandomGrayscale,
    RandomResizedCrop,
    rgb_to_grayscale,
    sample_generators,
)
from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.errors import ConfigError
from mmcache.loader import DataLoader
from mmcache.synth import make_dataset
from mmcache.transforms import CLIP_MEAN
from mmcache.transforms.normalize import normalize
from mmcache.transforms.pipeline import Pipeline

IMAGES = torch.randint(
    0, 256, (6, 3, 20, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
)


def test_jitter_is_per_sample_whatever_the_batch() -> None:
    jitter = ColorJitter(0.4, 0.4, 0.4, 0.1, p=0.8)
    whole = jitter(IMAGES, sample_generators(1, 2, range(6)))
    part = jitter(IMAGES[3:], sample_generators(1, 2, range(3, 6)))
    assert torch.equal(whole[3:], part)
    assert not torch.equal(whole, IMAGES)  # something changed
    listed = jitter(list(IMAGES), sample_generators(1, 2, range(6)))
    assert all(torch.equal(a, b) for a, b in zip(listed, whole, strict=True))


def test_probabilities_zero_and_one() -> None:
    gens = sample_generators(0, 0, range(6))
    assert torch.equal(ColorJitter(0.4, 0.4, 0.4, 0.1, p=0.0)(IMAGES, gens), IMAGES)
    grey = RandomGrayscale(1.0)(IMAGES, sample_generators(0, 0, range(6)))
    assert torch.equal(grey[:, 0], grey[:, 1]) and torch.equal(grey[:, 1], grey[:, 2])
    assert torch.equal(grey[:, :1], rgb_to_grayscale(IMAGES))
    assert torch.equal(RandomGrayscale(0.0)(IMAGES, gens), IMAGES)
    # 0.0 everywhere: every adjustment is off (torchvision's None), pixels unchanged.
    off = ColorJitter(0.0, 0.0, 0.0, 0.0)
    assert torch.equal(off(IMAGES, sample_generators(0, 0, range(6))), IMAGES)


def test_bad_configuration_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="hue"):
        ColorJitter(hue=0.7)
    with pytest.raises(ConfigError, match="brightness"):
        ColorJitter(brightness=-1)
    with pytest.raises(ConfigError, match="probability"):
        RandomGrayscale(1.5)
    with pytest.raises(ConfigError, match="interpolation"):
        RandomResizedCrop(8, interpolation="lanczos")  # type: ignore[arg-type]


def test_bicubic_crop_differs_from_bilinear_and_stays_uint8() -> None:
    gens = sample_generators(0, 0, range(6))
    cubic = RandomResizedCrop(12, interpolation="bicubic")(IMAGES, gens)
    linear = RandomResizedCrop(12)(IMAGES, sample_generators(0, 0, range(6)))
    assert cubic.dtype == torch.uint8 and cubic.shape == linear.shape == (6, 3, 12, 12)
    assert not torch.equal(cubic, linear)


def test_normalize_is_last_and_float() -> None:
    out = Normalize("clip")(IMAGES, sample_generators(0, 0, range(6)))
    assert torch.equal(out, normalize(IMAGES, CLIP_MEAN))
    assert all(isinstance(t, BUILTINS) for t in (ColorJitter(), RandomGrayscale(), Normalize()))


def test_loader_runs_the_chain_bitwise_reproducibly(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    ds = MultimodalDataset(make_dataset(tmp_path / "data", 24, seed=4), pipeline=small_pipeline)
    aug = Compose(
        [
            RandomResizedCrop(16, scale=(0.9, 1.0), interpolation="bicubic"),
            ColorJitter(0.4, 0.4, 0.4, 0.1, p=0.8),
            RandomGrayscale(0.2),
            Normalize("siglip"),
        ]
    )
    plain = [b["image"] for b in DataLoader(ds, cache=None, batch_size=8, seed=3, augment=aug)]
    with Cache(tmp_path / "c", memory=0, disk="64MiB") as cache:
        cold = DataLoader(ds, cache=cache, batch_size=8, seed=3, augment=aug, num_workers=2)
        cached = [b["image"] for b in cold]
    assert plain[0].dtype == torch.float32 and tuple(plain[0].shape) == (8, 3, 16, 16)
    assert all(torch.equal(a, b) for a, b in zip(plain, cached, strict=True))
