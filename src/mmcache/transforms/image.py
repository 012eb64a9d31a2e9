"""The image stage: an image file's bytes -> a uint8 ``[3, H, W]`` array (:class:`ImageSpec`).

Two steps, so that a cache-aware pipeline can reuse either:

* the **decode step** (:func:`read_file`, :func:`open_image`, :func:`decode_bytes`,
  :func:`load_image`) reads the file whole, refuses what is not an image or is too big
  (decompression bombs, files over ``max_bytes``) and decodes the pixels, at reduced size
  for a JPEG when the stage allows it (:meth:`ImageSpec.draft_size`);
* the **stage** itself (:meth:`ImageSpec.__call__`) maps the decoded image to the output
  array: EXIF orientation, centre crop (or none: ``crop=None`` keeps the aspect ratio),
  padding to a square (``pad_to_square``), resampling, colour. The orientation, colour
  and geometry helpers live in :mod:`mmcache.transforms.pixels`.

Geometry follows torchvision's ``Resize(resize)`` + ``CenterCrop(size)`` exactly
(shorter side to ``resize``, longer side ``int(resize * long / short)``, crop offset
``round((n - size) / 2)``), so with ``draft=False`` the image matches that pattern on
the EXIF-upright, RGB-converted image (up to a level of 255 or two from the rounding of
Pillow's fixed-point filter weights). Two things make it cheaper:

* **crop before resampling**: Pillow's ``resize(box=...)`` computes only the output
  pixels that survive the crop, with the same filter taps as a full resize;
* **reduced-size JPEG decoding** (``draft=True``, the default): when the shorter side is
  at least twice ``resize``, libjpeg decodes at 1/2, 1/4 or 1/8 scale (DCT scaling,
  ``Image.draft``) while keeping the shorter side >= ``resize``, then the resampling
  finishes the job. The DCT scaling filters a little less than a bicubic over the whole
  ratio, so the result is slightly sharper (README, "Preprocessing", has the measured
  difference and speed). ``draft=False`` gives the exact result.

EXIF orientation is honoured like ``ImageOps.exif_transpose`` would, but the crop is
computed in the upright frame, mapped back to the stored frame, resampled there and only
the small output is transposed: it costs nothing and keeps the partial DCT block of a
reduced decode on the side libjpeg puts it.

Colour: every mode becomes RGB. Transparent pixels (RGBA, LA, PA, P/L/RGB with a
``transparency`` key) are composited on **white** (:data:`ALPHA_BACKGROUND`), as most
web-image pipelines do; dropping alpha instead exposes whatever colour the encoder left
under transparent pixels, often black, sometimes garbage. 16-bit and 32-bit integer
greyscale (``I;16*``, ``I``) is scaled from 0..65535 to 0..255 (a 16-bit PNG opens as one
of these); ``F`` is clipped to 0..255 like Pillow's own conversion. Animated
GIF/WebP/PNG: the first frame.

Bad samples raise :class:`~mmcache.errors.SampleError` naming the sample id, the file and
the reason. Truncated images are errors: Pillow's ``ImageFile.LOAD_TRUNCATED_IMAGES`` is
never set here (if *you* set it, Pillow pads truncated images with grey and nobody can
tell; a warning is logged once).

Thread-safe: each call has its own image objects (Pillow releases the GIL while decoding).

>>> spec = ImageSpec(size=224)
>>> spec.resize
256
"""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, ClassVar, Literal, cast

import numpy as np
import numpy.typing as npt
import PIL
import xxhash
from PIL import Image, ImageFile, JpegImagePlugin, UnidentifiedImageError

from mmcache.checks import check_int
from mmcache.errors import ConfigError, SampleError
from mmcache.rootfiles import NotRegularFileError, open_regular
from mmcache.transforms.pixels import (
    ALPHA_BACKGROUND,
    DECODE_ERRORS,
    ORIENTATION_TRANSPOSE,
    PAD_FILL,
    checked_fill,
    crop_box,
    expand_to_square,
    orientation,
    resized_size,
    to_rgb_or_l,
    upright_rgb,
)
from mmcache.transforms.stage import DEFAULT_MAX_BYTES, ImageTraits, Stage, StageKind

__all__ = [
    "ALPHA_BACKGROUND",
    "PAD_FILL",
    "Crop",
    "ImageSpec",
    "Interpolation",
    "ReducedDecode",
    "decode_bytes",
    "image_header",
    "load_image",
    "open_image",
    "read_file",
]

logger = logging.getLogger(__name__)

Interpolation = Literal["bicubic", "bilinear", "lanczos", "nearest"]

_RESAMPLE: dict[str, Image.Resampling] = {
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
    "lanczos": Image.Resampling.LANCZOS,
    "nearest": Image.Resampling.NEAREST,
}

# Pillow's limit when this module was imported: the default of ImageSpec.max_pixels.
# Read once, so that later changes of the global by other code do not change
# what a spec means.
_PILLOW_MAX_PIXELS: int | None = Image.MAX_IMAGE_PIXELS

_PILLOW_MAJOR = int(PIL.__version__.split(".")[0])


_BOMB_PIXELS_RE = re.compile(r"\((\d+) pixels\)")

Crop = Literal["center"]


@functools.cache
def _warn_load_truncated_images() -> None:
    """Log once per process that someone turned Pillow's truncation check off."""
    logger.warning(
        "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set: Pillow pads truncated images silently, "
        "so they are not reported as SampleError"
    )


def _default_resize(size: int) -> int:
    return round(size * 256 / 224)


@dataclass(frozen=True)
class ReducedDecode:
    """How the decode step reduced an image: it holds the stored ``size`` (width, height)
    at ``1 / scale`` (a JPEG draft decode; ``scale`` is 2, 4 or 8)."""

    size: tuple[int, int]
    scale: float


@dataclass(frozen=True)
class ImageSpec:
    """How an image becomes a uint8 ``[3, H, W]`` array: the image :class:`Stage`.

    Args:
        size: side of the square output (``crop="center"``). With ``crop=None`` it is
            only the default of ``resize``.
        resize: the shorter side is resized to this; ``None`` means ``round(size * 256
            / 224)`` (256 for 224, the ImageNet/CLIP ratio) before a centre crop, and
            ``size`` with ``crop=None``. Must be >= ``size`` with a crop.
        interpolation: resampling filter (Pillow's, antialiased when downscaling).
        draft: allow reduced-size JPEG decoding when the source's shorter side is at
            least ``2 * resize`` (see the module docstring and :meth:`draft_size`).
        max_pixels: refuse images with more pixels than this (decompression bombs),
            read from the header before anything is decoded. ``None``: no limit of
            ours (Pillow's global ``Image.MAX_IMAGE_PIXELS`` still applies when it
            opens a file: raise it too to accept bigger images). The default is
            Pillow's limit at import time, about 89 MP.
        max_bytes: refuse image files larger than this many bytes (a video or a tar
            shard listed by mistake), from the file's size before anything is read,
            with a SampleError that ``on_error="skip"`` skips and counts. Default
            256 MiB; ``None``: no limit. Like ``max_pixels`` it decides which samples
            fail, never what a sample contains, so it is not in the fingerprint.
        crop: ``"center"`` (default): torchvision's ``Resize(resize)`` +
            ``CenterCrop(size)``, a ``[3, size, size]`` output. ``None``: no crop, the
            aspect ratio is kept (torchvision's ``Resize(resize, max_size=max_size)``):
            the shorter side becomes ``resize`` and entries have varied shapes
            ``[3, H, W]``; random crops after the cache (``mmcache.augment``) then see
            the whole image.
        max_size: with ``crop=None``, cap the longer side at this (the shorter side then
            shrinks below ``resize``, as torchvision does), so that a panorama does not
            make a huge entry. ``None``: no cap. Must be > ``resize``.
        pad_to_square: pad the upright RGB image to a square of ``fill`` colour before
            resizing (LLaVA's ``expand2square``), so nothing is cropped away.
        fill: the padding colour, RGB 0..255; default :data:`PAD_FILL` (the CLIP mean as
            uint8, as LLaVA pads). Only with ``pad_to_square=True``.
        exif_transpose: turn each image upright by its EXIF orientation (True, as
            ``ImageOps.exif_transpose`` and transformers' ``load_image`` do), or keep it
            as stored (False: what ``PIL.Image.open(path).convert("RGB")`` gives, as
            torchvision's and open_clip's loaders and qwen-vl-utils feed a phone photo
            stored sideways). :func:`mmcache.from_torchvision` sets False.
        channels_last: cache the pixels as ``[H, W, 3]`` (interleaved, as decoded): the
            loader then gives ``[B, 3, H, W]`` tensors in torch's ``channels_last``
            memory format (same values, other strides). CPU resampling (the random
            crops of :mod:`mmcache.augment`) and convolutions read that layout
            natively, where a ``[3, H, W]`` image costs an interleaving copy per crop
            (about half of a 224 px crop's time on the CPU, measured).

    ``crop``, ``max_size``, ``pad_to_square``, ``fill``, ``exif_transpose`` and
    ``channels_last`` enter the fingerprint only when they differ from their defaults,
    so the keys of existing caches are unchanged.

    A centre crop is cut from the whole resized image: exactly torchvision's
    ``Resize`` + ``CenterCrop`` on a PIL image. Only after a reduced (draft) decode is
    the crop's box alone resampled from the smaller image (the DCT scaling differs
    from a full decode anyway). Entries cached by mmcache before this rule (the box
    alone resampled, which Pillow rounds through another two-pass order: a few pixels
    along sharp edges up to about 20 levels off, most within one) keep their keys, as
    the pinned fingerprints require: a cache made before it serves them until they are
    made again (a new cache root makes them so).
    Raises ConfigError on invalid values. Immutable, picklable, thread-safe.

    >>> ImageSpec(size=336).resize
    384
    >>> ImageSpec(size=256, crop=None, max_size=512).resize
    256
    """

    kind: ClassVar[StageKind] = "image"

    size: int = 224
    resize: int | None = None
    interpolation: Interpolation = "bicubic"
    draft: bool = True
    max_pixels: int | None = field(default=_PILLOW_MAX_PIXELS)
    max_bytes: int | None = DEFAULT_MAX_BYTES
    crop: Crop | None = "center"
    max_size: int | None = None
    pad_to_square: bool = False
    fill: tuple[int, int, int] | None = None
    channels_last: bool = False
    exif_transpose: bool = True

    def __post_init__(self) -> None:
        check_int("ImageSpec.size", self.size, minimum=1)
        if self.crop not in ("center", None):
            raise ConfigError(
                f"ImageSpec.crop must be 'center' or None (keep the aspect ratio), "
                f"got {self.crop!r}"
            )
        if self.resize is None:
            default = _default_resize(self.size) if self.crop == "center" else self.size
            object.__setattr__(self, "resize", default)
        resize = check_int("ImageSpec.resize", self.resize, minimum=1)
        if self.crop == "center" and resize < self.size:
            raise ConfigError(
                f"ImageSpec.resize ({resize}) must be >= size ({self.size}): the centre crop "
                "is taken from the resized image"
            )
        if self.max_size is not None:
            check_int("ImageSpec.max_size", self.max_size, minimum=1)
            if self.crop is not None:
                raise ConfigError(
                    f"ImageSpec.max_size ({self.max_size}) applies only with crop=None "
                    "(a centre crop is square): pass crop=None or drop max_size"
                )
            if self.max_size <= resize:
                raise ConfigError(
                    f"ImageSpec.max_size ({self.max_size}) must be > resize ({resize}), "
                    "as torchvision's Resize requires"
                )
        if self.interpolation not in _RESAMPLE:
            raise ConfigError(
                f"ImageSpec.interpolation must be one of {sorted(_RESAMPLE)}, "
                f"got {self.interpolation!r}"
            )
        if not isinstance(self.draft, bool):
            raise ConfigError(f"ImageSpec.draft must be a bool, got {self.draft!r}")
        if self.max_pixels is not None:
            check_int("ImageSpec.max_pixels", self.max_pixels, minimum=1)
        if self.max_bytes is not None:
            check_int("ImageSpec.max_bytes", self.max_bytes, minimum=1)
        if not isinstance(self.pad_to_square, bool):
            raise ConfigError(f"ImageSpec.pad_to_square must be a bool, got {self.pad_to_square!r}")
        if not isinstance(self.channels_last, bool):
            raise ConfigError(f"ImageSpec.channels_last must be a bool, got {self.channels_last!r}")
        if not isinstance(self.exif_transpose, bool):
            raise ConfigError(
                f"ImageSpec.exif_transpose must be a bool, got {self.exif_transpose!r}"
            )
        if self.fill is not None and not self.pad_to_square:
            raise ConfigError(
                f"ImageSpec.fill ({self.fill!r}) is the colour of pad_to_square: "
                "pass pad_to_square=True or drop fill"
            )
        if self.pad_to_square:
            object.__setattr__(self, "fill", checked_fill(self.fill))

    @property
    def resize_to(self) -> int:
        """``resize`` as an int (it is never None after construction)."""
        return cast(int, self.resize)

    @property
    def fixed_shape(self) -> bool:
        """Whether every output has the same shape: a centre crop, or a square padding
        (then resized to ``resize`` x ``resize``). ``crop=None`` alone keeps each image's
        aspect ratio, so the loader batches such images as a list plus ``image_sizes``."""
        return self.crop is not None or self.pad_to_square

    def fingerprint_fields(self) -> dict[str, Any]:
        """Everything about this spec that changes its output (not ``max_pixels`` or
        ``max_bytes``: they decide which samples fail, never what a successful sample
        contains). :meth:`mmcache.Pipeline.fingerprint` is built from these fields;
        ``crop``, ``max_size`` and the padding appear only when not at their defaults,
        so the fingerprints of earlier specs are unchanged."""
        fields: dict[str, Any] = {
            "size": self.size,
            "resize": self.resize_to,
            "interpolation": self.interpolation,
            "crop": "center",
            "geometry": "torchvision",
            "draft": self.draft,
            "alpha_background": list(ALPHA_BACKGROUND),
            "decoder": "pillow",
            "decoder_major": _PILLOW_MAJOR,
        }
        if self.crop is None:
            fields["crop"] = None
            fields["max_size"] = self.max_size
        if self.pad_to_square:
            fields["pad_to_square"] = "expand2square"
            fields["fill"] = list(cast(tuple[int, int, int], self.fill))
        if self.channels_last:
            fields["layout"] = "hwc"
        if not self.exif_transpose:
            fields["exif"] = "as-stored"
        return fields

    def fingerprint(self) -> str:
        """xxh3-128 hex digest of :meth:`fingerprint_fields` (the :class:`Stage` fingerprint)."""
        blob = json.dumps(self.fingerprint_fields(), sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_hexdigest(blob.encode())

    def draft_size(self, width: int, height: int) -> tuple[int, int] | None:
        """The size to ask a reduced-size JPEG decode of a ``width`` x ``height`` image
        for (``Image.draft``), or ``None`` for a full decode.

        The decode step asks this *before* decoding (libjpeg scales while it decodes);
        it then passes what the decoder did as ``reduced`` to :meth:`__call__`. Pillow
        picks the largest DCT scale (1/2, 1/4, 1/8) that keeps both sides >= the
        requested size, so the shorter side stays >= ``resize``. ``None`` when
        ``draft=False`` or the shorter side is under ``2 * resize`` (no scale would
        apply).

        >>> ImageSpec(size=224).draft_size(2000, 1500), ImageSpec(size=224).draft_size(640, 480)
        ((256, 256), None)
        """
        resize = self.resize_to
        if self.draft and min(width, height) >= 2 * resize:
            return (resize, resize)
        return None

    def __call__(
        self,
        im: Image.Image,
        /,
        *,
        reduced: ReducedDecode | None = None,
        sample_id: str = "<image>",
        path: str | None = None,
    ) -> npt.NDArray[np.uint8]:
        """A decoded image (its stored frame: EXIF orientation is read here and applied)
        -> uint8 ``[3, size, size]`` (``[3, H, W]`` with ``crop=None``), C-contiguous.

        ``reduced``: set when the decode step decoded ``im`` at reduced size after
        :meth:`draft_size` (the crop is computed on the stored size, then scaled).
        ``sample_id`` and ``path`` name the sample in a :class:`SampleError` (an image
        mode that cannot become RGB). Thread-safe.
        """
        try:
            if self.pad_to_square:
                # Pad in the upright RGB frame (the fill is an RGB colour, and LLaVA pads
                # the upright image); a reduced decode is then just a smaller image.
                fill = cast(tuple[int, int, int], self.fill)
                src = expand_to_square(upright_rgb(im, transpose=self.exif_transpose), fill)
                turn, width, height = 1, src.width, src.height
                reduced = None
            else:
                turn = orientation(im) if self.exif_transpose else 1
                width, height = im.size if reduced is None else reduced.size
                src = to_rgb_or_l(im)
        except (ValueError, OSError) as exc:
            raise SampleError(
                f"cannot convert image mode {im.mode} to RGB: {exc}", sample_id=sample_id, path=path
            ) from exc
        if self.crop == "center" and reduced is None:
            out = self._exact_center_crop(src, turn)
        else:
            out = self._box_resize(src, turn, width, height, reduced)
        if out.mode != "RGB":
            out = out.convert("RGB")
        if self.channels_last:
            return np.array(out)  # a writable copy (Pillow's buffer view is read-only)
        hwc = np.asarray(out)
        return np.ascontiguousarray(hwc.transpose(2, 0, 1))

    def _box_resize(
        self,
        src: Image.Image,
        turn: int,
        width: int,
        height: int,
        reduced: ReducedDecode | None,
    ) -> Image.Image:
        """The output resampled from its box of the stored frame (only the output's
        pixels computed), then turned upright."""
        if self.crop == "center":
            box = crop_box(width, height, turn, self.size, self.resize_to)
            stored_out = (self.size, self.size)
        else:
            box = (0.0, 0.0, float(width), float(height))
            swapped = turn >= 5
            uw, uh = resized_size(
                *((height, width) if swapped else (width, height)), self.resize_to, self.max_size
            )
            stored_out = (uh, uw) if swapped else (uw, uh)
        if reduced is not None:
            scale = reduced.scale
            box = (box[0] / scale, box[1] / scale, box[2] / scale, box[3] / scale)
        out = src.resize(stored_out, _RESAMPLE[self.interpolation], box=box)
        if turn != 1:
            out = out.transpose(ORIENTATION_TRANSPOSE[turn])
        return out

    def _exact_center_crop(self, src: Image.Image, turn: int) -> Image.Image:
        """torchvision's ``Resize(resize)`` + ``CenterCrop(size)`` of the upright image,
        pixel for pixel: the whole image resampled, then cut. Why not the crop box alone
        (:func:`~mmcache.transforms.pixels.crop_box`, the ``draft=True`` path): Pillow
        resamples in two passes with an 8-bit intermediate and picks their order from
        the sizes, so a box resize of the crop rounds and clips differently from the
        whole resize where both axes change (up to ~20 levels at sharp edges,
        measured); the whole image costs ``resize / size`` times more output pixels."""
        if turn != 1:
            src = src.transpose(ORIENTATION_TRANSPOSE[turn])
        nw, nh = resized_size(src.width, src.height, self.resize_to, None)
        full = src.resize((nw, nh), _RESAMPLE[self.interpolation])
        left = round((nw - self.size) / 2.0)
        top = round((nh - self.size) / 2.0)
        return full.crop((left, top, left + self.size, top + self.size))


# ----------------------------------------------------------------------------------------------
# The decode step
# ----------------------------------------------------------------------------------------------


def _open_regular(path: str, sample_id: str, max_bytes: int | None) -> tuple[int, os.stat_result]:
    """A descriptor of the regular, non-empty file ``path`` and its ``fstat``, refused
    (SampleError with a plain reason) when it is not one or is over ``max_bytes``.

    The file is opened by :func:`mmcache.rootfiles.open_regular` (``O_NONBLOCK``, so a
    FIFO never blocks the opener; a FIFO or device refused by its ``fstat`` mode
    before anything is read). Every read of an image file, whole (:func:`read_file`)
    or of its header only (:func:`open_image_file`), opens it here."""
    try:
        fd, st = open_regular(path, flags=getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise SampleError("file not found", sample_id=sample_id, path=path) from None
    except IsADirectoryError:
        raise SampleError("is a directory", sample_id=sample_id, path=path) from None
    except NotRegularFileError:
        raise SampleError("not a regular file", sample_id=sample_id, path=path) from None
    except PermissionError:
        raise SampleError("permission denied", sample_id=sample_id, path=path) from None
    except ValueError as exc:
        # os.open raises ValueError, not OSError, for a path no file can have: an
        # embedded NUL, or (UnicodeEncodeError) a lone surrogate. The manifest readers
        # reject both; this covers paths that reach the pipeline another way.
        if "\x00" in path:
            reason = "invalid path: it contains a NUL byte"
        else:
            reason = f"invalid path: {exc}"
        raise SampleError(reason, sample_id=sample_id, path=path) from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            reason = "symlink loop (too many levels of symbolic links)"
        else:
            reason = f"cannot open file: {exc.strerror or exc}"
        raise SampleError(reason, sample_id=sample_id, path=path) from exc
    refused: str | None = None
    if st.st_size == 0:
        refused = "empty file"
    elif max_bytes is not None and st.st_size > max_bytes:
        refused = (
            f"file is {st.st_size} bytes, over the limit of {max_bytes} bytes (ImageSpec.max_bytes)"
        )
    if refused is not None:
        os.close(fd)
        raise SampleError(refused, sample_id=sample_id, path=path)
    return fd, st


def read_file(path: str, sample_id: str, max_bytes: int | None) -> bytes:
    """The whole file, or SampleError with a plain reason.

    Reading it in one go (rather than letting Pillow read lazily from the path)
    separates I/O errors from decode errors and catches empty files, directories and
    special files before any decoder sees them (:func:`_open_regular`). A file over
    ``max_bytes`` is refused from its ``fstat`` size, and reads stop past the limit
    should it grow meanwhile: nothing allocates more than ``max_bytes + 1``.
    """
    fd, st = _open_regular(path, sample_id, max_bytes)
    try:
        chunks = []
        total = 0
        budget = (max_bytes + 1) if max_bytes is not None else None
        while True:  # one read for the whole file, one more to see the end
            want = max(st.st_size, 1 << 16)
            chunk = os.read(fd, want if budget is None else min(want, budget - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if max_bytes is not None and total > max_bytes:  # grew after fstat
                raise SampleError(
                    f"file is more than {max_bytes} bytes, over the limit "
                    "(ImageSpec.max_bytes); it grew while being read",
                    sample_id=sample_id,
                    path=path,
                )
    except IsADirectoryError:
        raise SampleError("is a directory", sample_id=sample_id, path=path) from None
    except OSError as exc:
        reason = f"cannot read file: {exc.strerror or exc}"
        raise SampleError(reason, sample_id=sample_id, path=path) from exc
    finally:
        os.close(fd)
    data = b"".join(chunks) if len(chunks) != 1 else chunks[0]
    if not data:  # emptied between fstat and read
        raise SampleError("empty file", sample_id=sample_id, path=path)
    return data


def _bomb_reason(message: str, max_pixels: int | None) -> str:
    """Reason for Pillow's own decompression-bomb error/warning raised at open."""
    match = _BOMB_PIXELS_RE.search(message)
    pixels = match.group(1) if match else "too many"
    if max_pixels is not None and match and int(match.group(1)) > max_pixels:
        return f"image has {pixels} pixels, over the limit of {max_pixels} (ImageSpec.max_pixels)"
    return (
        f"image has {pixels} pixels, over Pillow's global limit "
        f"(PIL.Image.MAX_IMAGE_PIXELS={Image.MAX_IMAGE_PIXELS}; raise it to accept such images)"
    )


def open_image(
    data: bytes | IO[bytes], *, max_pixels: int | None, sample_id: str, path: str | None
) -> Image.Image:
    """``Image.open`` on ``data`` (bytes, or a file object read lazily; nothing decoded
    yet), refusing what is not an image and images of more than ``max_pixels`` pixels
    (from the header; a decompression bomb too). Raises SampleError."""
    try:
        im = Image.open(io.BytesIO(data) if isinstance(data, bytes) else data)
    except Image.DecompressionBombError as exc:
        reason = _bomb_reason(str(exc), max_pixels)
        raise SampleError(reason, sample_id=sample_id, path=path) from exc
    except Image.DecompressionBombWarning as exc:  # when warnings are turned into errors
        reason = _bomb_reason(str(exc), max_pixels)
        raise SampleError(reason, sample_id=sample_id, path=path) from exc
    except UnidentifiedImageError as exc:
        reason = "not an image (no image format Pillow knows matches its content)"
        raise SampleError(reason, sample_id=sample_id, path=path) from exc
    except DECODE_ERRORS as exc:
        reason = f"not an image or corrupt header: {exc}"
        raise SampleError(reason, sample_id=sample_id, path=path) from exc
    width, height = im.size
    pixels = width * height
    if max_pixels is not None and pixels > max_pixels:
        im.close()
        raise SampleError(
            f"image has {pixels} pixels, over the limit of {max_pixels} (ImageSpec.max_pixels)",
            sample_id=sample_id,
            path=path,
        )
    if width < 1 or height < 1:
        im.close()
        raise SampleError(f"image has no pixels ({width}x{height})", sample_id=sample_id, path=path)
    return im


@contextlib.contextmanager
def image_header(
    path: str, *, sample_id: str, max_bytes: int | None, max_pixels: int | None
) -> Iterator[Image.Image]:
    """The image at ``path`` opened for its header only (size, EXIF orientation), through
    the same guard as :func:`read_file` (regular files only, never blocking on a FIFO or a
    device, ``max_bytes`` from ``fstat``) and :func:`open_image` (``max_pixels``,
    decompression bombs): each is a SampleError naming the sample. Closed on exit."""
    fd, _ = _open_regular(path, sample_id, max_bytes)
    with os.fdopen(fd, "rb") as fh:
        im = open_image(fh, max_pixels=max_pixels, sample_id=sample_id, path=path)
        with im:
            yield im


def _decode_pixels(
    im: Image.Image, spec: ImageSpec | None, *, sample_id: str, path: str | None
) -> ReducedDecode | None:
    """Decode ``im``'s pixels, at the reduced size ``spec.draft_size`` asks for when it
    is a JPEG; return how it was reduced (``None``: full size). Raises SampleError."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        _warn_load_truncated_images()
    reduced = None
    try:
        if isinstance(im, JpegImagePlugin.JpegImageFile):
            # draft() must come before load(); a JPEG's getexif() (read by the stage)
            # reads only the APP1 segment, never the pixels.
            width, height = im.size
            want = None if spec is None else spec.draft_size(width, height)
            if want is not None:
                drafted = im.draft("RGB", want)
                if drafted is not None:
                    # The box of the full image in reduced coordinates: the exact scale.
                    reduced = ReducedDecode(size=(width, height), scale=width / drafted[1][2])
        # Decode before anything reads EXIF: for PNG (and other formats whose EXIF may
        # sit after the pixel data) getexif() loads the pixels itself and the stage
        # must swallow EXIF errors, so a corrupt IDAT would vanish there and leave a
        # half-decoded (black) image.
        im.load()
    except DECODE_ERRORS as exc:
        raise SampleError(
            f"truncated or corrupt image: {exc}", sample_id=sample_id, path=path
        ) from exc
    return reduced


def decode_bytes(
    stage: ImageSpec | Stage, data: bytes, *, sample_id: str, path: str | None = None
) -> Any:
    """An image file's bytes through the decode step and the image ``stage``.

    With an :class:`ImageSpec`, its limits apply and JPEGs are decoded at the size
    it asks for (:meth:`ImageSpec.draft_size`); the result is uint8 ``[3, H, W]``.
    Any other image :class:`Stage` gets the fully decoded image in its stored frame
    (refused over Pillow's pixel limit at import, ImageSpec's default) and returns
    what it returns; a SampleError it raises is re-raised naming this sample.
    Raises SampleError. Thread-safe.
    """
    spec = stage if isinstance(stage, ImageSpec) else None
    max_pixels = _PILLOW_MAX_PIXELS if spec is None else spec.max_pixels
    with open_image(data, max_pixels=max_pixels, sample_id=sample_id, path=path) as im:
        reduced = _decode_pixels(im, spec, sample_id=sample_id, path=path)
        if spec is None:
            try:
                return stage(im)
            except SampleError as err:  # a user stage names no sample: this one
                raise SampleError(err.reason, sample_id=sample_id, path=path) from err
        return spec(im, reduced=reduced, sample_id=sample_id, path=path)


def load_image(stage: ImageSpec | Stage, path: str | os.PathLike[str], *, sample_id: str) -> Any:
    """Read ``path`` (within the stage's ``max_bytes``: :class:`ImageTraits`, 256 MiB
    unless it declares another) and :func:`decode_bytes` it. Raises SampleError for every
    bad-file case."""
    path_str = os.fspath(path)
    data = read_file(path_str, sample_id, ImageTraits.of(stage).max_bytes)
    return decode_bytes(stage, data, sample_id=sample_id, path=path_str)


if TYPE_CHECKING:  # mypy checks that ImageSpec conforms to the protocol

    def _conforms(spec: ImageSpec) -> Stage:
        return spec
