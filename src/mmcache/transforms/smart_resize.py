"""Dynamic resolution for vision-language models: :class:`SmartResize` (Qwen2-VL's
``smart_resize`` rule as a cached image stage) and :func:`output_hw`, the processed
size of an image from its header alone.

:class:`SmartResize` resizes each image, upright and in RGB, to the ``(h, w)`` of
:func:`smart_resize`: both sides multiples of ``factor``, ``h * w`` within
``[min_pixels, max_pixels]``, the aspect ratio kept as closely as that allows (the rule
of ``transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize``). Entries
are uint8 ``[3, h, w]`` of varied shapes. For Qwen2-VL (``factor=28``: patch 14, merge
2) an image becomes ``(h / 28) * (w / 28)`` tokens (:meth:`SmartResize.image_tokens`)
and its grid is ``(1, h / 14, w / 14)`` (:meth:`SmartResize.grid_thw`).

:func:`output_hw` gives the ``(h, w)`` an image stage makes of an image of a given
stored size and EXIF orientation, for :class:`SmartResize` and
:class:`~mmcache.transforms.image.ImageSpec`: how sample lengths are known without
decoding a pixel.

Pure and immutable; thread-safe.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import xxhash
from PIL import Image

from mmcache.checks import check_int
from mmcache.errors import ConfigError, SampleError
from mmcache.transforms.image import _RESAMPLE, ImageSpec, Interpolation
from mmcache.transforms.pixels import applies_orientation, resized_size, upright_rgb
from mmcache.transforms.stage import StageKind

__all__ = ["SizeRule", "SmartResize", "output_hw", "smart_resize"]


@runtime_checkable
class SizeRule(Protocol):
    """An image stage that knows the ``(h, w)`` it makes of an upright ``height x width``
    image without decoding it (``None``: not known for this one), such as
    ``hf_image_processor(...)``."""

    def output_size(self, height: int, width: int) -> tuple[int, int] | None: ...


_MAX_ASPECT = 200


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's rule: ``(h, w)`` multiples of ``factor`` with ``min_pixels <= h * w <=
    max_pixels`` (when ``factor**2`` fits), aspect kept. ValueError for an aspect ratio
    over 200, as transformers raises."""
    if max(height, width) / min(height, width) > _MAX_ASPECT:
        raise ValueError(
            f"absolute aspect ratio must be smaller than {_MAX_ASPECT}, "
            f"got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class SmartResize:
    """Qwen2-VL's dynamic resolution as an image :class:`~mmcache.transforms.stage.Stage`.

    Args:
        min_pixels, max_pixels: the bounds on ``h * w`` (Qwen2-VL's defaults:
            ``56 * 56`` and ``28 * 28 * 1280``).
        factor: both output sides are multiples of it (28 = patch 14 x merge 2).
        interpolation: Pillow's resampling filter (Qwen2-VL resizes bicubic).
        exif_transpose: turn images upright by their EXIF orientation (True: as
            transformers' ``load_image`` gives them to the processor) or keep them as
            stored (False: as qwen-vl-utils' ``fetch_image`` opens them; a sideways
            phone photo's grid is then the stored ``(h, w)``). In the fingerprint only
            when False.

    Output uint8 ``[3, h, w]``, C-contiguous, varied shapes (``fixed_shape`` is False).
    A SampleError for an image whose aspect ratio exceeds 200. Immutable, picklable.

    >>> SmartResize(min_pixels=56 * 56, max_pixels=28 * 28 * 1280).output_size(480, 640)
    (476, 644)
    """

    kind: ClassVar[StageKind] = "image"
    fixed_shape: ClassVar[bool] = False

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    factor: int = 28
    interpolation: Interpolation = "bicubic"
    exif_transpose: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.exif_transpose, bool):
            raise ConfigError(
                f"SmartResize.exif_transpose must be a bool, got {self.exif_transpose!r}"
            )
        check_int("SmartResize.factor", self.factor, minimum=2)
        check_int("SmartResize.min_pixels", self.min_pixels, minimum=1)
        check_int("SmartResize.max_pixels", self.max_pixels, minimum=1)
        if self.max_pixels < self.min_pixels:
            raise ConfigError(
                f"SmartResize.max_pixels ({self.max_pixels}) is below min_pixels "
                f"({self.min_pixels})"
            )
        if self.interpolation not in _RESAMPLE:
            raise ConfigError(
                f"SmartResize.interpolation must be one of {sorted(_RESAMPLE)}, "
                f"got {self.interpolation!r}"
            )

    @property
    def patch(self) -> int:
        """The vision patch side, ``factor // 2`` (Qwen2-VL's merge of 2)."""
        return self.factor // 2

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """The ``(h, w)`` an upright ``height x width`` image is resized to."""
        return smart_resize(
            height,
            width,
            factor=self.factor,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )

    def image_tokens(self, h: int, w: int) -> int:
        """Tokens of a processed ``h x w`` image: ``(h / factor) * (w / factor)``
        (pass it as ``ChatSpec(image_tokens=spec.image_tokens)``)."""
        return (h // self.factor) * (w // self.factor)

    def grid_thw(self, h: int, w: int) -> tuple[int, int, int]:
        """Qwen2-VL's ``image_grid_thw`` of a processed image: ``(1, h / patch, w / patch)``."""
        return (1, h // self.patch, w // self.patch)

    def fingerprint_fields(self) -> dict[str, Any]:
        """Everything that changes the output."""
        return {
            "stage": "SmartResize",
            "version": 1,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "factor": self.factor,
            "interpolation": self.interpolation,
            "frame": "upright-rgb" if self.exif_transpose else "stored-rgb",
        }

    def fingerprint(self) -> str:
        """xxh3-128 hex digest of :meth:`fingerprint_fields`."""
        blob = json.dumps(self.fingerprint_fields(), sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_hexdigest(blob.encode())

    def __call__(self, im: Image.Image, /) -> npt.NDArray[np.uint8]:
        """A decoded image (stored frame) -> uint8 ``[3, h, w]``. Raises SampleError."""
        src = upright_rgb(im, transpose=self.exif_transpose)
        try:
            h, w = self.output_size(src.height, src.width)
        except ValueError as exc:
            raise SampleError(str(exc), sample_id="<image>") from exc
        out = src.resize((w, h), _RESAMPLE[self.interpolation])
        return np.ascontiguousarray(np.asarray(out).transpose(2, 0, 1))


def output_hw(stage: object, width: int, height: int, turn: int = 1) -> tuple[int, int] | None:
    """The ``(h, w)`` ``stage`` makes of an image stored as ``width x height`` with EXIF
    orientation ``turn`` (ignored by a stage that keeps images as stored); ``None`` for
    a stage whose geometry is not known here (a user stage, an HF processor whose size
    rule is not read: only decoding tells). Pure: no pixel is read."""
    if turn >= 5 and applies_orientation(stage):  # upright, the sides are swapped
        width, height = height, width
    if isinstance(stage, SmartResize):
        try:
            return stage.output_size(height, width)
        except ValueError:
            return None
    if isinstance(stage, ImageSpec):
        if stage.crop == "center":
            return (stage.size, stage.size)
        if stage.pad_to_square:
            width = height = max(width, height)
        uw, uh = resized_size(width, height, stage.resize_to, stage.max_size)
        return (uh, uw)
    if isinstance(stage, SizeRule):
        return stage.output_size(height, width)
    return None


if TYPE_CHECKING:  # mypy checks that SmartResize conforms to the protocol
    from mmcache.transforms.stage import Stage

    def _conforms(spec: SmartResize) -> Stage:
        return spec
