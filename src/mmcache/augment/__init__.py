"""Seeded random augmentation of cached uint8 images, run on each batch after the cache.

The transforms (:mod:`mmcache.augment.core`: crops, flips, the per-sample seeds;
:mod:`mmcache.augment.color`: colour jitter, greyscale, the final normalisation)
and :func:`from_torchvision`, which splits a torchvision ``Compose`` (open_clip's
``preprocess_train``) into a cached stage and these
(:mod:`mmcache.augment.torchvision`). Every name here is importable from
``mmcache.augment``.

open_clip's ``aug_cfg`` and torchvision's transforms, and what they become:

- ``Resize(n)`` + ``CenterCrop(m)`` (open_clip's eval): ``ImageSpec(size=m, resize=n)``,
  cached;
- ``RandomResizedCrop(s, scale, ratio, interpolation)`` (``aug_cfg.scale``):
  ``ImageSpec(size=R, crop=None, resize=R)`` cached, ``R = crop_source_size(s, scale,
  ratio)``, then ``RandomResizedCrop(s, scale=, ratio=, interpolation="bicubic")``;
- ``aug_cfg.color_jitter`` + ``color_jitter_prob`` (open_clip's ``color_jitter``),
  ``RandomApply([ColorJitter(...)], p)``: ``ColorJitter(b, c, s, h, p=p)``;
- ``aug_cfg.gray_scale_prob`` (open_clip's ``gray_scale``), ``RandomGrayscale(p)``:
  ``RandomGrayscale(p)``;
- ``RandomHorizontalFlip(p)``: ``RandomHorizontalFlip(p)`` (open_clip has none);
- ``ToTensor()`` + ``Normalize(mean, std)``: ``Normalize(mean, std)``, last, on the
  loader's device.
"""

from __future__ import annotations

from mmcache.augment.color import ColorJitter, Normalize, RandomGrayscale, rgb_to_grayscale
from mmcache.augment.core import (
    Augment,
    Compose,
    Images,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resample,
    augment_into,
    batch_generator,
    check_images,
    output_size,
    reseed_generators,
    sample_generators,
    sample_seed,
)
from mmcache.augment.torchvision import crop_source_size, from_torchvision

__all__ = [
    "BUILTINS",
    "Augment",
    "ColorJitter",
    "Compose",
    "Images",
    "Normalize",
    "RandomGrayscale",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resample",
    "augment_into",
    "batch_generator",
    "check_images",
    "crop_source_size",
    "from_torchvision",
    "output_size",
    "reseed_generators",
    "rgb_to_grayscale",
    "sample_generators",
    "sample_seed",
]

#: The classes whose instances get one generator per image (any other augment one per batch).
BUILTINS = (
    RandomResizedCrop,
    RandomHorizontalFlip,
    Compose,
    ColorJitter,
    RandomGrayscale,
    Normalize,
)
