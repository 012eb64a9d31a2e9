"""A torchvision ``Compose`` split into a cached image stage and an augment after the cache.

:func:`from_torchvision` takes the transform a training script already has
(torchvision v1 or v2 ``Compose``, such as open_clip's ``preprocess_train`` and
``preprocess_val``) and returns ``(image_stage, augment)``:

- the **deterministic prefix** (``Resize``, ``CenterCrop``, RGB conversion)
  becomes an :class:`~mmcache.ImageSpec`, cached as uint8;
- when the first random transform is a ``RandomResizedCrop`` with nothing
  before it (open_clip's ``preprocess_train``), the cache holds the **whole
  image**, shorter side resized to :func:`crop_source_size` (large enough that
  the smallest crop the scale and ratio allow still has ``size`` pixels on its
  shorter side, so the crop is a downscale from the cached image as it is from
  the original), and the crop runs after the cache;
- the random part and what follows it (``RandomResizedCrop``,
  ``RandomHorizontalFlip``, ``ColorJitter``, ``RandomApply([ColorJitter])``,
  ``RandomGrayscale``, ``Grayscale(3)``, open_clip's ``color_jitter`` and
  ``gray_scale``) become the :mod:`mmcache.augment` transforms, seeded per sample;
- ``ToTensor`` (open_clip's ``MaybeToTensor``), ``ToImage`` +
  ``ToDtype(float32, scale=True)`` and ``Normalize``
  become a final :class:`~mmcache.augment.Normalize` (on the loader's
  ``device``).

Anything else (a ``Lambda``, a ``Resize`` after the random crop, a squash
``Resize((h, w))``, a ``CenterCrop`` that pads, open_clip's ``ResizeKeepRatio``
and ``CenterCropOrPad`` of ``resize_mode="longest"``) raises :class:`ConfigError`
naming the transform and its position, never a silently different pipeline.

Where the result differs from the torchvision pipeline (all measured in
``tests/reference`` against torchvision and open_clip):

- random draws come from each sample's generator (seed, epoch, index), not torch's
  global RNG: the same distribution of crop boxes, other boxes;
- a random crop from the cache resamples twice (the cached resize, then the
  crop's resize with torch's antialiased kernel); the pixels of one box are
  within about one level of 255 of torchvision's on average;
- colour jitter uses torchvision's tensor kernels; torchvision on a PIL image
  (open_clip's order: jitter before ``ToTensor``) uses Pillow's ``ImageEnhance``,
  which rounds differently (a level or two);
- transparent pixels are composited on white (:mod:`mmcache.transforms.image`);
  Pillow's ``convert("RGB")``, open_clip's ``_convert_to_rgb``, drops the alpha.

Pure function of its argument; nothing is imported from torchvision (the
transforms are read by their class names and attributes), so it runs where
torchvision is installed beside another torch build, or not at all.
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from typing import Any

from mmcache.augment.color import ColorJitter, Normalize, RandomGrayscale
from mmcache.augment.core import Augment, Compose, RandomHorizontalFlip, RandomResizedCrop
from mmcache.errors import ConfigError
from mmcache.transforms.image import ImageSpec

__all__ = ["crop_source_size", "from_torchvision"]

# Transforms that change nothing of an image already decoded to uint8 RGB.
_RGB = {"_convert_to_rgb", "RGB", "MaybeConvertMode"}
_TO_FLOAT = {"ToTensor", "MaybeToTensor", "ConvertImageDtype", "ToDtype"}
_TO_TENSOR = {"PILToTensor", "ToImage", "ToPureTensor"}
_INTERPOLATIONS = {"bilinear", "bicubic", "lanczos", "nearest"}


def crop_source_size(size: int, scale: Sequence[float], ratio: Sequence[float]) -> int:
    """The shorter side to cache a random crop's source at: the smallest ``R`` such that
    every crop ``RandomResizedCrop(size, scale, ratio)`` can draw from an image of shorter
    side ``R`` has at least ``size`` pixels on each side (so its resize is a downscale,
    as it is from a large original). 273 for open_clip's ``(224, (0.9, 1.0))``.

    >>> crop_source_size(224, (0.9, 1.0), (3 / 4, 4 / 3))
    273
    """
    narrowest = min(float(ratio[0]), 1.0 / float(ratio[1]))
    return math.ceil(size / math.sqrt(float(scale[0]) * narrowest))


def _name(t: object) -> str:
    """``"torchvision.Resize"``, ``"open_clip._convert_to_rgb"``, ... or ``"?"``."""
    if isinstance(t, types.FunctionType):  # open_clip's _convert_to_rgb is a function
        module, name = t.__module__ or "", t.__name__
    else:
        module, name = type(t).__module__, type(t).__name__
    if module.startswith("torchvision.transforms"):
        return f"torchvision.{name}"
    if module.startswith("open_clip"):
        return f"open_clip.{name}"
    return "?"


def _flatten(transform: object) -> list[Any]:
    kind = _name(transform).split(".")[-1]
    if kind == "Compose" or isinstance(transform, (list, tuple)):
        items = transform if isinstance(transform, (list, tuple)) else transform.transforms  # type: ignore[attr-defined]
        return [x for t in items for x in _flatten(t)]
    return [transform]


def _side(what: str, t: object, size: object) -> int:
    """A square side from an int, ``[n]`` or ``(n, n)``; ConfigError for anything else."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    if isinstance(size, (list, tuple)) and len(size) in (1, 2) and len(set(size)) == 1:
        return int(size[0])
    raise ConfigError(f"from_torchvision: {what} {t!r} has size {size!r}: only square sizes split")


def _interpolation(t: object, allowed: set[str]) -> str:
    mode = getattr(t, "interpolation", "bilinear")
    value = str(getattr(mode, "value", mode)).lower()
    if value not in allowed:
        raise ConfigError(
            f"from_torchvision: {t!r} uses interpolation {value!r}; mmcache has {sorted(allowed)}"
        )
    return value


class _Split:
    """The walk over the flattened transforms: prefix -> stage, the rest -> augments."""

    def __init__(
        self, resize: int | None, channels_last: bool, draft: bool, exif_transpose: bool
    ) -> None:
        self.exif_transpose = exif_transpose
        self.resize_override = resize
        self.channels_last = channels_last
        self.draft = draft
        self.resize: tuple[int, str, int | None] | None = None  # (side, interpolation, max)
        self.crop: int | None = None
        self.augments: list[Augment] = []
        self.random = False  # a random transform has been met: no more deterministic steps
        self.to_float = False
        self.normalize: tuple[Sequence[float], Sequence[float]] | None = None

    def refuse(self, i: int, t: object, why: str) -> ConfigError:
        return ConfigError(f"from_torchvision cannot split transform {i} ({t!r}): {why}")

    def take(self, i: int, t: Any) -> None:
        name = _name(t)
        kind = name.split(".")[-1]
        if name == "?":
            raise self.refuse(i, t, "not a torchvision or open_clip transform")
        after_float = self.normalize is not None or (self.to_float and kind != "Normalize")
        if after_float and kind not in _RGB:
            raise self.refuse(i, t, "only Normalize may follow ToTensor/ToDtype")
        if kind in _RGB and getattr(t, "mode", "RGB") != "RGB":
            raise self.refuse(i, t, f"converts to mode {t.mode!r}; the cache holds RGB")
        if kind in _RGB or kind in _TO_TENSOR:
            return
        if kind in _TO_FLOAT:
            if kind == "ToDtype" and not getattr(t, "scale", False):
                raise self.refuse(i, t, "ToDtype without scale=True keeps 0..255 floats")
            self.to_float = True
        elif kind == "Normalize":
            self.normalize = (tuple(t.mean), tuple(t.std))
        elif kind in {"Resize", "CenterCrop"}:
            self.deterministic(i, t, kind)
        else:
            self.random = True
            self.augments.append(self.augment(i, t, kind))

    def deterministic(self, i: int, t: Any, kind: str) -> None:
        if self.random:
            raise self.refuse(i, t, "a deterministic step after a random one cannot be cached")
        if kind == "Resize":
            if self.resize is not None or self.crop is not None:
                raise self.refuse(i, t, "only one Resize, before the CenterCrop, splits")
            side = _side("Resize", t, t.size)
            if not isinstance(t.size, int) and len(t.size) == 2:
                raise self.refuse(i, t, "Resize((h, w)) squashes the aspect: use Resize(n)")
            max_size = getattr(t, "max_size", None)
            self.resize = (side, _interpolation(t, _INTERPOLATIONS), max_size)
            return
        if self.resize is None or self.crop is not None:
            raise self.refuse(i, t, "a CenterCrop splits only after one Resize(n)")
        crop = _side("CenterCrop", t, t.size)
        if crop > self.resize[0] or self.resize[2] is not None:
            raise self.refuse(i, t, "a CenterCrop larger than the Resize (padding) does not split")
        self.crop = crop

    def augment(self, i: int, t: Any, kind: str) -> Augment:
        if kind == "RandomResizedCrop":
            if any(isinstance(a, RandomResizedCrop) for a in self.augments):
                raise self.refuse(i, t, "only one random crop splits")
            return RandomResizedCrop(
                _side("RandomResizedCrop", t, t.size),
                scale=tuple(t.scale),
                ratio=tuple(t.ratio),
                antialias=bool(getattr(t, "antialias", True) in (True, None)),
                interpolation=_interpolation(t, {"bilinear", "bicubic"}),  # type: ignore[arg-type]
            )
        if kind == "RandomHorizontalFlip":
            return RandomHorizontalFlip(float(t.p))
        if kind == "ColorJitter":
            return _jitter(t, 1.0)
        if kind == "RandomApply":
            inner = list(t.transforms)
            if len(inner) != 1 or _name(inner[0]).split(".")[-1] != "ColorJitter":
                raise self.refuse(i, t, "RandomApply splits only around one ColorJitter")
            return _jitter(inner[0], float(t.p))
        if kind == "color_jitter":  # open_clip's: ColorJitter with probability p
            return _jitter(t.transf, float(t.p))
        if kind in {"RandomGrayscale", "gray_scale", "Grayscale"}:
            channels = getattr(getattr(t, "transf", t), "num_output_channels", 3)
            if channels != 3:
                raise self.refuse(i, t, "grayscale with 1 output channel does not batch")
            return RandomGrayscale(1.0 if kind == "Grayscale" else float(t.p))
        raise self.refuse(i, t, "no mmcache.augment equivalent")

    def stage(self, i_crop: RandomResizedCrop | None) -> ImageSpec:
        common: dict[str, Any] = {
            "draft": self.draft,
            "channels_last": self.channels_last,
            "exif_transpose": self.exif_transpose,
        }
        if self.resize is None:
            if i_crop is None:
                raise ConfigError(
                    "from_torchvision: the Compose has neither a Resize nor a "
                    "RandomResizedCrop, so there is no image size to cache"
                )
            side = self.resize_override or crop_source_size(i_crop.size, i_crop.scale, i_crop.ratio)
            return ImageSpec(size=side, crop=None, resize=side, **common)
        side, interp, max_size = self.resize
        if self.crop is not None:
            return ImageSpec(size=self.crop, resize=side, interpolation=interp, **common)  # type: ignore[arg-type]
        return ImageSpec(
            size=side,
            crop=None,
            resize=side,
            max_size=max_size,
            interpolation=interp,  # type: ignore[arg-type]
            **common,
        )


def _jitter(t: Any, p: float) -> ColorJitter:
    def rng(value: Any) -> Any:
        return 0.0 if value is None else tuple(float(v) for v in value)

    return ColorJitter(rng(t.brightness), rng(t.contrast), rng(t.saturation), rng(t.hue), p=p)


def from_torchvision(
    transform: object,
    *,
    resize: int | None = None,
    draft: bool = False,
    channels_last: bool = True,
    exif_transpose: bool = False,
) -> tuple[ImageSpec, Compose]:
    """``(image_stage, augment)`` equivalent to a torchvision (v1 or v2) ``Compose``.

    Args:
        transform: a ``torchvision.transforms.Compose`` or ``transforms.v2.Compose``
            (or a list of transforms), such as open_clip's ``preprocess_train`` or
            ``preprocess_val``.
        resize: the shorter side to cache a random crop's whole source at, instead of
            :func:`crop_source_size` (a smaller entry for a small ``scale``, whose crops
            are then upsampled from fewer pixels than the original has).
        draft: allow reduced-size JPEG decoding in the cached stage (faster cold
            epochs, slightly sharper than Pillow's resize; off by default to match).
        channels_last: cache interleaved pixels (the CPU crop reads them natively).
        exif_transpose: turn images upright by their EXIF orientation. Off by default,
            as torchvision's ``ImageFolder`` / ``default_loader`` and open_clip's
            datasets open them (``Image.open(path).convert("RGB")``): a phone photo
            stored sideways reaches the model sideways there, and here.

    Returns:
        the :class:`~mmcache.ImageSpec` to put in the ``Pipeline`` and the
        :class:`~mmcache.augment.Compose` to pass as ``DataLoader(..., augment=)``.

    Raises:
        ConfigError: naming the first transform that cannot be split, and why.

    >>> stage, augment = from_torchvision([])  # doctest: +SKIP
    """
    split = _Split(resize, channels_last, draft, exif_transpose)
    for i, t in enumerate(_flatten(transform)):
        split.take(i, t)
    crop = next((a for a in split.augments if isinstance(a, RandomResizedCrop)), None)
    stage = split.stage(crop)
    augments = list(split.augments)
    if split.to_float or split.normalize is not None:
        mean, std = split.normalize or ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
        augments.append(Normalize(mean, std))
    return stage, Compose(augments)
