"""LLaVA-NeXT's any-resolution image processing as the cached stage: :class:`LlavaNextImageStage`,
and its image-token count: :class:`LlavaNextTokens`.

``LlavaNextImageProcessor`` turns one image into ``1 + k`` crops of its crop size: the
whole image resized to that size, then the ``k`` tiles of the image resized (aspect
kept) and zero-padded to the best of its ``image_grid_pinpoints`` for the image's
original size. ``LlavaNextProcessor`` gives that image a number of ``<image>`` tokens
that is a function of the *original* size (the base crop's patches, plus the
"unpadded" features of the tiles and one newline per row of them).

:class:`LlavaNextImageStage` caches exactly what the processor makes before it
rescales and normalises: it calls the processor itself with ``do_rescale=False,
do_normalize=False`` (whichever backend it is: Pillow's and torchvision's resize
differ by a level, so the stage never resizes on its own) and returns
:class:`Crops`: the uint8 ``[1 + k, 3, h, w]`` crops and the original upright
``(height, width)``. Values that are not whole numbers ``0..255`` are refused, never
rounded. :meth:`mmcache.Pipeline.process_chat` caches the crops, counts the image's
tokens from the original size and records both (``image_crops``,
``image_original_sizes``); after the cache,
:class:`~mmcache.transforms.model_inputs.PixelValues` (``layout="llava_next"``)
normalises and pads them into the model's ``pixel_values`` ``[N, max_crops, 3, h, w]``.

:class:`LlavaNextTokens` is ``ChatSpec(image_tokens=)`` for such a pipeline: the
processor's own rule (``LlavaNextProcessor._get_number_of_features``, less one for
``vision_feature_select_strategy="default"``, as its ``replace_image_token`` does),
run on the processor's class with the few values it reads, so it is plain data:
fingerprinted by value and pickled without the processor.

Fingerprint of the stage: the processor's class, configuration and transformers'
major version. Immutable; pickles with the processor into spawn-started workers;
processors keep no state between calls.
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
from PIL import Image

from mmcache.errors import ConfigError, SampleError
from mmcache.transforms.hf import (
    probe_pixels,
    processor_fingerprint,
    processor_identity,
    processor_mean_std,
)
from mmcache.transforms.pixels import upright_rgb
from mmcache.transforms.stage import StageKind

__all__ = ["Crops", "LlavaNextImageStage", "LlavaNextTokens"]

#: Bump when what this stage caches for the same processor changes.
LLAVA_NEXT_STAGE_VERSION = 1


@dataclass(frozen=True)
class Crops:
    """One image as an any-resolution stage makes it: ``pixels`` uint8 ``[1 + k, 3, h,
    w]`` (the base image, then its ``k`` tiles) and ``original``, the upright image's
    ``(height, width)`` before any resize (what its token count is a function of)."""

    pixels: npt.NDArray[np.uint8]
    original: tuple[int, int]


class LlavaNextImageStage:
    """A ``LlavaNextImageProcessor`` (either backend) as the cached image stage of a chat
    pipeline (see the module docstring). Build it with :func:`mmcache.hf_processor`.

    Attributes:
        processor: the image processor.
        mean, std: the processor's, for :func:`mmcache.normalize`.
        crop_size: the ``(h, w)`` of every crop it makes (read from a probe run).
    """

    kind: ClassVar[StageKind] = "image"
    fixed_shape: ClassVar[bool] = False

    def __init__(self, processor: Any, *, exif_transpose: bool = True) -> None:
        if not isinstance(exif_transpose, bool):
            raise ConfigError(f"exif_transpose must be a bool, got {exif_transpose!r}")
        if not callable(processor) or not hasattr(processor, "image_grid_pinpoints"):
            raise ConfigError(
                "LlavaNextImageStage needs a LlavaNextImageProcessor (one with "
                f"image_grid_pinpoints), got {type(processor).__name__}"
            )
        self.processor = processor
        #: Upright (transformers' ``load_image``) or as stored; named in the
        #: fingerprint only when as stored (the stages made before keep their keys).
        self.exif_transpose = exif_transpose
        self._fingerprint = processor_fingerprint(
            "hf_llava_next" if exif_transpose else "hf_llava_next/as-stored",
            LLAVA_NEXT_STAGE_VERSION,
            processor,
        )
        self.mean, self.std = processor_mean_std(processor)
        # Refuse now, not in a worker at the first sample, a processor whose crops are
        # not uint8-valued; learn the crop size its output has.
        try:
            crops = self._run(Image.fromarray(probe_pixels()))
        except SampleError as exc:
            raise ConfigError(f"hf_processor cannot cache this processor: {exc.reason}") from None
        self.crop_size: tuple[int, int] = (int(crops.shape[2]), int(crops.shape[3]))

    def fingerprint(self) -> str:
        """Digest of the processor's class, configuration and transformers' major version."""
        return self._fingerprint

    def __repr__(self) -> str:
        return f"LlavaNextImageStage({type(self.processor).__name__})"

    def _run(self, rgb: Image.Image) -> npt.NDArray[np.uint8]:
        """The processor's crops of one upright RGB image, as uint8 (SampleError when
        they are not whole numbers ``0..255`` or not ``[1 + k, 3, h, w]``)."""
        name = type(self.processor).__name__
        out = self.processor(rgb, do_rescale=False, do_normalize=False, return_tensors="np")
        values = np.asarray(out["pixel_values"])
        if values.ndim == 5 and values.shape[0] == 1:
            values = values[0]
        if values.ndim != 4 or values.shape[1] != 3 or values.shape[0] < 1:
            raise SampleError(
                f"{name} made pixel_values of shape {list(values.shape)} for one image; "
                "LLaVA-NeXT's are [1 + k, 3, h, w]",
                sample_id="<image>",
            )
        if values.dtype != np.uint8:
            whole = np.issubdtype(values.dtype, np.number) and np.array_equal(
                values, np.clip(np.round(values), 0, 255)
            )
            if not whole:
                raise SampleError(
                    f"{name} returned {values.dtype} crops that are not whole numbers 0..255 "
                    "before rescale and normalise; only uint8 pixels are cached (exact), "
                    "never rounded",
                    sample_id="<image>",
                )
            values = values.astype(np.uint8)
        return np.ascontiguousarray(values)

    def __call__(self, im: Image.Image, /) -> Crops:
        """A decoded image (stored frame) -> its :class:`Crops`: the processor's uint8
        crops and the upright original ``(height, width)``. Raises SampleError."""
        src = upright_rgb(im, transpose=self.exif_transpose)
        return Crops(self._run(src), (src.height, src.width))


def _processor_class(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot import {path} for its image-token rule: {exc}") from exc


def _expanded(processor: Any, height: int, width: int, crop_size: tuple[int, int]) -> int:
    """How many image tokens ``processor`` itself writes for an image of original size
    ``height x width`` made into crops of ``crop_size`` (its ``replace_image_token``,
    given the two values it reads; ``_get_number_of_features`` less one for the
    "default" strategy where a processor has no such method)."""
    replace = getattr(processor, "replace_image_token", None)
    if replace is None:
        n = int(processor._get_number_of_features(height, width, *crop_size))
        return n - 1 if processor.vision_feature_select_strategy == "default" else n
    inputs = {"image_sizes": [[height, width]], "pixel_values": np.zeros((1, 1, 3, *crop_size))}
    return len(replace(inputs, 0)) // len(processor.image_token)


@dataclass(frozen=True)
class LlavaNextTokens:
    """``LlavaNextProcessor``'s image-token count of an image of original size ``(h, w)``
    (``ChatSpec(image_tokens=LlavaNextTokens.of(processor, crop_size))``).

    The processor's own method runs on a stand-in holding only the values it reads
    (the pinpoints, the vision patch size, the additional tokens), so this object is
    plain data: its fingerprint is its values, it pickles without the processor, and
    :meth:`of` checks it against the processor itself. Immutable, thread-safe."""

    processor_class: str
    grid_pinpoints: tuple[tuple[int, int], ...]
    patch_size: int
    crop_size: tuple[int, int]
    num_additional_image_tokens: int
    default_strategy: bool
    transformers_major: int

    @classmethod
    def of(cls, processor: Any, crop_size: tuple[int, int]) -> LlavaNextTokens:
        """The rule of ``processor`` (a ``LlavaNextProcessor``) for crops of ``crop_size``;
        ConfigError when it has no ``patch_size`` or this rule and the processor's
        own expansion of an ``<image>`` (its ``replace_image_token``) disagree on a
        grid of sizes."""
        patch = getattr(processor, "patch_size", None)
        if isinstance(patch, bool) or not isinstance(patch, int) or patch < 1:
            raise ConfigError(
                f"{type(processor).__name__} has no patch_size: build it with "
                "patch_size=, vision_feature_select_strategy= (as the model config says)"
            )
        klass = type(processor)
        pinpoints = tuple(
            (int(h), int(w)) for h, w in processor.image_processor.image_grid_pinpoints
        )
        rule = cls(
            processor_class=f"{klass.__module__}.{klass.__qualname__}",
            grid_pinpoints=pinpoints,
            patch_size=patch,
            crop_size=(int(crop_size[0]), int(crop_size[1])),
            num_additional_image_tokens=int(processor.num_additional_image_tokens or 0),
            default_strategy=processor.vision_feature_select_strategy == "default",
            transformers_major=int(
                processor_identity(processor.image_processor)["transformers_major"]
            ),
        )
        for h, w in ((30, 40), (40, 30), (17, 300), (300, 17), (480, 640), (1000, 333)):
            try:
                want, got = _expanded(processor, h, w, rule.crop_size), rule(h, w)
            except AttributeError as exc:  # a transformers without the size rule
                raise ConfigError(
                    f"{klass.__name__} of this transformers has no image-token rule of the "
                    f"original size ({exc}): upgrade transformers"
                ) from exc
            if got != want:
                raise ConfigError(
                    f"{klass.__name__}'s image-token count of a {h}x{w} image is {want}, "
                    f"but its rule run on the values it reads gives {got}: a "
                    "processor whose count reads other state is not supported"
                )
        return rule

    def __call__(self, height: int, width: int) -> int:
        """Tokens of an image whose original upright size is ``height x width``."""
        klass = _processor_class(self.processor_class)
        stand_in = types.SimpleNamespace(
            image_processor=types.SimpleNamespace(
                image_grid_pinpoints=[list(p) for p in self.grid_pinpoints]
            ),
            patch_size=self.patch_size,
            num_additional_image_tokens=self.num_additional_image_tokens,
        )
        stand_in._get_unpadded_features = types.MethodType(klass._get_unpadded_features, stand_in)
        n = int(klass._get_number_of_features(stand_in, height, width, *self.crop_size))
        return n - 1 if self.default_strategy else n


if TYPE_CHECKING:  # mypy checks that LlavaNextImageStage conforms to the protocol
    from mmcache.transforms.stage import Stage

    def _conforms(s: LlavaNextImageStage) -> Stage:
        return s
