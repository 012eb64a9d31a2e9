"""Preprocessing: decode, resize and centre-crop images; tokenize captions; fingerprint it all.

A :class:`Pipeline` turns one record (an image path and a caption) into the arrays
that mmcache caches: ``image`` (uint8 ``[3, size, size]``, C-contiguous) and
``input_ids`` / ``attention_mask`` (int32 ``[max_length]``). Float conversion and
normalisation are left to the training device (:func:`normalize`): a uint8 sample is
4x smaller in every cache tier and on every copy than the float32 tensor the
design note's ``ToTensor`` pattern produces.

Geometry follows torchvision's ``Resize(resize)`` + ``CenterCrop(size)`` exactly
(shorter side to ``resize``, longer side ``int(resize * long / short)``, crop offset
``round((n - size) / 2)``), so with ``draft=False`` the image matches that
pattern on the EXIF-upright, RGB-converted image (up to a level of 255 or two from
the rounding of Pillow's fixed-point filter weights). Two things make it cheaper:

* **crop before resampling**: Pillow's ``resize(box=...)`` computes only the output
  pixels that survive the crop, with the same filter taps as a full resize;
* **reduced-size JPEG decoding** (``draft=True``, the default): when the shorter
  side is at least twice ``resize``, libjpeg decodes at 1/2, 1/4 or 1/8 scale
  (DCT scaling, ``Image.draft``) while keeping the shorter side >= ``resize``, then
  the bicubic resize finishes the job. The DCT scaling filters a little less than
  a bicubic over the whole ratio, so the result is slightly sharper. Measured on
  the synthetic data of :mod:`mmcache.synth` (heavily textured, so a hard case),
  mean |difference| to the full decode, in levels of 255: 1.0 on average over
  1,000-2,000 px sources (worst image 2.6, 99.9% of pixels within 9); 2.0 on
  COCO-sized sources whose shorter side is 512-640 px (worst image 4.1, 99.9% of
  pixels within 17; single edge pixels up to about 45). Those decode about 2x
  faster, 1,000-2,000 px sources 2-2.5x. ``draft=False`` gives the exact result.

EXIF orientation is honoured like ``ImageOps.exif_transpose`` would, but the crop is
computed in the upright frame, mapped back to the stored frame, resampled there and
only the small output is transposed: it costs nothing and keeps the partial DCT
block of a reduced decode on the side libjpeg puts it.

Colour: every mode becomes RGB. Transparent pixels (RGBA, LA, PA, P/L/RGB with a
``transparency`` key) are composited on **white** (:data:`ALPHA_BACKGROUND`), as most
web-image pipelines do; dropping alpha instead exposes whatever colour the encoder
left under transparent pixels, often black, sometimes garbage. 16-bit and 32-bit
integer greyscale (``I;16*``, ``I``) is scaled from 0..65535 to 0..255 (a 16-bit PNG
opens as one of these); ``F`` is clipped to 0..255 like Pillow's own conversion.
Animated GIF/WebP/PNG: the first frame.

Bad samples raise :class:`~mmcache.errors.SampleError` naming the sample id, the
file and the reason. Truncated images are errors: Pillow's
``ImageFile.LOAD_TRUNCATED_IMAGES`` is never set here (if *you* set it, Pillow pads
truncated images with grey and nobody can tell; a warning is logged once).

Thread and process safety: a :class:`Pipeline` is immutable after construction.
:meth:`Pipeline.process` may be called from several threads at once (Pillow
releases the GIL while decoding; each call has its own image objects; the tokenizer
is only read). A pipeline pickles to plain data (the tokenizer as its JSON string),
so spawn/forkserver DataLoader workers rebuild it cheaply. Captions are encoded one
at a time, never with ``encode_batch``: that keeps the tokenizers library from
starting its Rayon thread pool, which would make it warn and fall back to one thread
in every forked worker.

>>> spec = ImageSpec(size=224)
>>> spec.resize
256
"""

from __future__ import annotations

import errno
import functools
import io
import json
import logging
import os
import re
import stat
import string
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
import numpy.typing as npt
import PIL
import xxhash
from PIL import Image, ImageFile, JpegImagePlugin, UnidentifiedImageError
from tokenizers import Encoding, Tokenizer

from mmcache.errors import ConfigError, SampleError
from mmcache.units import MiB

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    import torch

__all__ = [
    "ALPHA_BACKGROUND",
    "CLIP_MEAN",
    "CLIP_STD",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "PIPELINE_FORMAT_VERSION",
    "ImageSpec",
    "Interpolation",
    "Pipeline",
    "TextSpec",
    "normalize",
    "train_tokenizer",
]

logger = logging.getLogger(__name__)

#: Bump when the meaning of a pipeline's output changes for the same parameters
#: (geometry convention, colour handling...): it is part of :meth:`Pipeline.fingerprint`.
PIPELINE_FORMAT_VERSION = 1

#: Colour that transparent pixels are composited on.
ALPHA_BACKGROUND: tuple[int, int, int] = (255, 255, 255)

CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)

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

# The default of ImageSpec.max_bytes. A large photo is tens of MiB (a 100 MP
# 16-bit TIFF about 600 MiB is the rare exception, raise the limit for those);
# a file far larger is a video or an archive listed by mistake, and reading it
# whole would raise MemoryError, which no on_error policy catches.
_DEFAULT_MAX_BYTES = 256 * MiB

_EXIF_ORIENTATION_TAG = 0x0112
# EXIF orientation -> the transpose that makes the image upright (as ImageOps.exif_transpose).
_ORIENTATION_TRANSPOSE: dict[int, Image.Transpose] = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}

# What Pillow raises on corrupt data, besides OSError (fuzzing finds all of these;
# Pillow's own fuzz tests accept the same set). Anything else is a bug and propagates.
_DECODE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    struct.error,
    IndexError,
)

_BOMB_PIXELS_RE = re.compile(r"\((\d+) pixels\)")

_INT16_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})


@functools.cache
def _warn_load_truncated_images() -> None:
    """Log once per process that someone turned Pillow's truncation check off."""
    logger.warning(
        "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set: Pillow pads truncated images silently, "
        "so they are not reported as SampleError"
    )


def _default_resize(size: int) -> int:
    return round(size * 256 / 224)


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


# ----------------------------------------------------------------------------------------------
# Image
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageSpec:
    """How an image file becomes a uint8 ``[3, size, size]`` array.

    Args:
        size: side of the square output.
        resize: the shorter side is resized to this before the centre crop; ``None``
            means ``round(size * 256 / 224)`` (256 for 224, the ImageNet/CLIP ratio).
            Must be >= ``size``.
        interpolation: resampling filter (Pillow's, antialiased when downscaling).
        draft: allow reduced-size JPEG decoding when the source's shorter side is at
            least ``2 * resize`` (see the module docstring for the measured deviation).
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

    Raises ConfigError on invalid values.

    >>> ImageSpec(size=336).resize
    384
    """

    size: int = 224
    resize: int | None = None
    interpolation: Interpolation = "bicubic"
    draft: bool = True
    max_pixels: int | None = field(default=_PILLOW_MAX_PIXELS)
    max_bytes: int | None = _DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        _check_int("ImageSpec.size", self.size, minimum=1)
        if self.resize is None:
            object.__setattr__(self, "resize", _default_resize(self.size))
        resize = _check_int("ImageSpec.resize", self.resize, minimum=1)
        if resize < self.size:
            raise ConfigError(
                f"ImageSpec.resize ({resize}) must be >= size ({self.size}): the centre crop "
                "is taken from the resized image"
            )
        if self.interpolation not in _RESAMPLE:
            raise ConfigError(
                f"ImageSpec.interpolation must be one of {sorted(_RESAMPLE)}, "
                f"got {self.interpolation!r}"
            )
        if not isinstance(self.draft, bool):
            raise ConfigError(f"ImageSpec.draft must be a bool, got {self.draft!r}")
        if self.max_pixels is not None:
            _check_int("ImageSpec.max_pixels", self.max_pixels, minimum=1)
        if self.max_bytes is not None:
            _check_int("ImageSpec.max_bytes", self.max_bytes, minimum=1)

    @property
    def resize_to(self) -> int:
        """``resize`` as an int (it is never None after construction)."""
        return cast(int, self.resize)

    def fingerprint_fields(self) -> dict[str, Any]:
        """Everything about this spec that changes its output (not ``max_pixels`` or
        ``max_bytes``: they decide which samples fail, never what a successful sample
        contains)."""
        return {
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


def _read_file(path: str, sample_id: str, max_bytes: int | None) -> bytes:
    """The whole file, or SampleError with a plain reason.

    Reading it in one go (rather than letting Pillow read lazily from the path)
    separates I/O errors from decode errors and catches empty files, directories and
    special files before any decoder sees them. ``O_NONBLOCK`` keeps a FIFO from
    blocking the reader forever; it has no effect on regular files. A file over
    ``max_bytes`` is refused from its ``fstat`` size, and reads stop past the limit
    should it grow meanwhile: nothing allocates more than ``max_bytes + 1``.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise SampleError("file not found", sample_id=sample_id, path=path) from None
    except IsADirectoryError:
        raise SampleError("is a directory", sample_id=sample_id, path=path) from None
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
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise SampleError("is a directory", sample_id=sample_id, path=path)
        if not stat.S_ISREG(st.st_mode):
            raise SampleError("not a regular file", sample_id=sample_id, path=path)
        if st.st_size == 0:
            raise SampleError("empty file", sample_id=sample_id, path=path)
        if max_bytes is not None and st.st_size > max_bytes:
            raise SampleError(
                f"file is {st.st_size} bytes, over the limit of {max_bytes} bytes "
                "(ImageSpec.max_bytes)",
                sample_id=sample_id,
                path=path,
            )
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


def _orientation(im: Image.Image) -> int:
    """EXIF orientation 1..8 (1 when absent or unreadable).

    Call it after ``im.load()`` for every format but JPEG: a PNG's ``getexif()`` decodes
    the pixels to reach a trailing ``eXIf`` chunk, and the errors swallowed here would
    then include a corrupt image's (see :func:`_decode`).
    """
    try:
        value = im.getexif().get(_EXIF_ORIENTATION_TAG, 1)
    except _DECODE_ERRORS:
        # Broken EXIF is common in the wild and does not make the pixels unusable.
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _crop_box(
    width: int, height: int, orientation: int, size: int, resize: int
) -> tuple[float, float, float, float]:
    """The source box (stored frame, float pixel edges) that becomes the output.

    The geometry is torchvision's Resize(resize) + CenterCrop(size), evaluated in the
    upright frame (after EXIF orientation), then mapped back to the stored frame.
    """
    swapped = orientation >= 5
    uw, uh = (height, width) if swapped else (width, height)
    # torchvision's _compute_resized_output_size: short side -> resize, long side truncated.
    if uw <= uh:
        nw, nh = resize, int(resize * uh / uw)
    else:
        nw, nh = int(resize * uw / uh), resize
    left = round((nw - size) / 2.0)
    top = round((nh - size) / 2.0)
    sx, sy = uw / nw, uh / nh
    x0, y0, x1, y1 = left * sx, top * sy, (left + size) * sx, (top + size) * sy
    w, h = width, height  # stored frame
    # Inverse of each transpose, on continuous coordinates (pixel edges).
    if orientation == 2:
        return (w - x1, y0, w - x0, y1)
    if orientation == 3:
        return (w - x1, h - y1, w - x0, h - y0)
    if orientation == 4:
        return (x0, h - y1, x1, h - y0)
    if orientation == 5:
        return (y0, x0, y1, x1)
    if orientation == 6:
        return (y0, h - x1, y1, h - x0)
    if orientation == 7:
        return (w - y1, h - x1, w - y0, h - x0)
    if orientation == 8:
        return (w - y1, x0, w - y0, x1)
    return (x0, y0, x1, y1)


def _to_rgb_or_l(im: Image.Image) -> Image.Image:
    """Convert to RGB, or to L when that is exact (resampling 1 channel is 3x cheaper
    and L -> RGB afterwards is a plain copy into three channels)."""
    mode = im.mode
    # (Image.has_transparency_data says the same, but only from Pillow 10.1.)
    if mode in ("RGBA", "LA", "PA") or "transparency" in im.info:
        rgba = im.convert("RGBA")
        background = Image.new("RGB", rgba.size, ALPHA_BACKGROUND)
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    if mode in ("RGB", "L"):
        return im
    if mode in _INT16_MODES:
        values = np.asarray(im, dtype=np.int64)
        scaled = (np.clip(values, 0, 65535) + 128) // 257
        return Image.fromarray(scaled.astype(np.uint8), mode="L")
    if mode == "F":
        values = np.asarray(im, dtype=np.float32)
        clipped = np.clip(np.rint(np.nan_to_num(values, nan=0.0)), 0, 255)
        return Image.fromarray(clipped.astype(np.uint8), mode="L")
    if mode == "1":
        return im.convert("L")
    return im.convert("RGB")


def _load_image(
    spec: ImageSpec, path: str | os.PathLike[str], *, sample_id: str
) -> npt.NDArray[np.uint8]:
    """Decode ``path`` into a uint8 ``[3, size, size]`` C-contiguous array (see :class:`ImageSpec`).

    Raises SampleError for every bad-file case. Thread-safe.
    """
    path_str = os.fspath(path)
    data = _read_file(path_str, sample_id, spec.max_bytes)
    try:
        im = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        reason = _bomb_reason(str(exc), spec.max_pixels)
        raise SampleError(reason, sample_id=sample_id, path=path_str) from exc
    except Image.DecompressionBombWarning as exc:  # when warnings are turned into errors
        reason = _bomb_reason(str(exc), spec.max_pixels)
        raise SampleError(reason, sample_id=sample_id, path=path_str) from exc
    except UnidentifiedImageError as exc:
        reason = "not an image (no image format Pillow knows matches its content)"
        raise SampleError(reason, sample_id=sample_id, path=path_str) from exc
    except _DECODE_ERRORS as exc:
        reason = f"not an image or corrupt header: {exc}"
        raise SampleError(reason, sample_id=sample_id, path=path_str) from exc
    with im:
        width, height = im.size
        pixels = width * height
        if spec.max_pixels is not None and pixels > spec.max_pixels:
            raise SampleError(
                f"image has {pixels} pixels, over the limit of {spec.max_pixels} "
                "(ImageSpec.max_pixels)",
                sample_id=sample_id,
                path=path_str,
            )
        if width < 1 or height < 1:
            raise SampleError(
                f"image has no pixels ({width}x{height})", sample_id=sample_id, path=path_str
            )
        return _decode(spec, im, sample_id=sample_id, path=path_str)


def _decode(
    spec: ImageSpec, im: Image.Image, *, sample_id: str, path: str
) -> npt.NDArray[np.uint8]:
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        _warn_load_truncated_images()
    width, height = im.size
    size, resize = spec.size, spec.resize_to
    is_jpeg = isinstance(im, JpegImagePlugin.JpegImageFile)
    try:
        if not is_jpeg:
            # Decode before reading EXIF: for PNG (and other formats whose EXIF may sit
            # after the pixel data) getexif() loads the pixels itself, and _orientation
            # must swallow EXIF errors, so a corrupt IDAT would vanish there and the
            # later load() would be a no-op on a half-decoded (black) image. JPEG is
            # the exception: draft() must come before load(), and its getexif() reads
            # only the APP1 segment, never the pixels.
            im.load()
        orientation = _orientation(im)
        box = _crop_box(width, height, orientation, size, resize)
        if spec.draft and is_jpeg and min(width, height) >= 2 * resize:
            # Pillow picks the largest DCT scale (1/2, 1/4, 1/8) that keeps both sides
            # >= resize, i.e. the shorter side stays >= resize. It returns the box of the
            # full image in reduced coordinates, which gives the exact scale factor.
            drafted = im.draft("RGB", (resize, resize))
            if drafted is not None:
                scale = width / drafted[1][2]
                box = (box[0] / scale, box[1] / scale, box[2] / scale, box[3] / scale)
        im.load()  # the (possibly reduced) JPEG decode; a no-op for the other formats
    except _DECODE_ERRORS as exc:
        raise SampleError(
            f"truncated or corrupt image: {exc}", sample_id=sample_id, path=path
        ) from exc
    try:
        src = _to_rgb_or_l(im)
    except (ValueError, OSError) as exc:
        raise SampleError(
            f"cannot convert image mode {im.mode} to RGB: {exc}", sample_id=sample_id, path=path
        ) from exc
    out = src.resize((size, size), _RESAMPLE[spec.interpolation], box=box)
    if orientation != 1:
        out = out.transpose(_ORIENTATION_TRANSPOSE[orientation])
    if out.mode != "RGB":
        out = out.convert("RGB")
    hwc = np.asarray(out)
    return np.ascontiguousarray(hwc.transpose(2, 0, 1))


# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------

_PAD_TOKENS = ("[PAD]", "<pad>")
_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")
_BASE_ALPHABET = string.ascii_lowercase + string.digits + string.punctuation

# Long captions are tokenized through a bounded prefix (TextSpec._encode_long): the
# first prefix holds max_length * _PREFIX_CHARS_PER_TOKEN characters (1,024 for 16
# tokens, far more than any normal caption, so those never take that path), then
# it grows _PREFIX_GROWTH-fold until it is safe to cut there (see _prefix_is_final).
_PREFIX_CHARS_PER_TOKEN = 64
_PREFIX_GROWTH = 4
# Tokens, and whole pre-tokenized words, that must follow the kept tokens in the
# prefix's encoding before its cut can no longer change them.
_PREFIX_MARGIN_TOKENS = 8
_PREFIX_MARGIN_WORDS = 2


def _canonical_tokenizer_json(tokenizer_json: str) -> str:
    """The tokenizer's JSON with sorted keys and without the padding/truncation
    settings (TextSpec overrides those; they are fingerprinted separately)."""
    doc = json.loads(tokenizer_json)
    doc.pop("padding", None)
    doc.pop("truncation", None)
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class TextSpec:
    """How a caption becomes int32 ``input_ids`` and ``attention_mask`` of ``max_length``.

    Args:
        tokenizer: a ``tokenizer.json`` path or a :class:`tokenizers.Tokenizer`. The
            object is copied: your tokenizer's padding and truncation settings are
            left untouched.
        max_length: every caption is truncated (special tokens included) and padded
            (on the right) to this length. Only as much of a long caption as that
            needs is tokenized (:meth:`encode`).
        pad_id: the padding id; by default the tokenizer's ``[PAD]`` or ``<pad>``
            token, else 0.

    A TextSpec is immutable; it pickles as the tokenizer's JSON string. Thread-safe.
    Raises ConfigError on invalid values or an unreadable tokenizer file.
    """

    __slots__ = (
        "_canonical",
        "_content_length",
        "_json",
        "_tokenizer",
        "_untruncated",
        "max_length",
        "pad_id",
    )

    _json: str
    _canonical: str | None
    _tokenizer: Tokenizer
    _untruncated: Tokenizer | None
    _content_length: int
    max_length: int
    pad_id: int

    def __init__(
        self,
        tokenizer: str | os.PathLike[str] | Tokenizer,
        max_length: int = 32,
        pad_id: int | None = None,
    ) -> None:
        if isinstance(tokenizer, Tokenizer):
            tokenizer_json = tokenizer.to_str()
        elif isinstance(tokenizer, (str, os.PathLike)):
            try:
                tokenizer_json = Tokenizer.from_file(os.fspath(tokenizer)).to_str()
            except Exception as exc:  # the Rust side raises plain Exception subclasses
                raise ConfigError(
                    f"cannot load a tokenizer from {os.fspath(tokenizer)!r}: {exc} "
                    "(expected a tokenizers 'tokenizer.json' file)"
                ) from exc
        else:
            raise ConfigError(
                "TextSpec.tokenizer must be a tokenizer.json path or a tokenizers.Tokenizer, "
                f"got {type(tokenizer).__name__}"
            )
        self._setup(tokenizer_json, max_length, pad_id)

    def _setup(self, tokenizer_json: str, max_length: int, pad_id: int | None) -> None:
        max_length = _check_int("TextSpec.max_length", max_length, minimum=1)
        tok = Tokenizer.from_str(tokenizer_json)
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        if pad_id is None:
            found = (tok.token_to_id(t) for t in _PAD_TOKENS)
            pad_id = next((i for i in found if i is not None), 0)
        else:
            pad_id = _check_int("TextSpec.pad_id", pad_id, minimum=0)
            if pad_id >= vocab_size:
                raise ConfigError(
                    f"TextSpec.pad_id ({pad_id}) is outside the vocabulary (size {vocab_size})"
                )
        pad_token = tok.id_to_token(pad_id) or _PAD_TOKENS[0]
        tok.enable_truncation(max_length)
        tok.enable_padding(direction="right", pad_id=pad_id, pad_token=pad_token, length=max_length)
        try:
            probe = tok.encode("")
        except Exception as exc:
            raise ConfigError(
                f"TextSpec.max_length={max_length} does not work with this tokenizer: {exc}"
            ) from exc
        if len(probe.ids) != max_length:
            raise ConfigError(
                f"TextSpec.max_length={max_length} is shorter than the special tokens this "
                f"tokenizer adds ({len(probe.ids)})"
            )
        object.__setattr__(self, "_json", tokenizer_json)
        object.__setattr__(self, "_canonical", None)
        object.__setattr__(self, "_tokenizer", tok)
        object.__setattr__(self, "_untruncated", None)
        # How many text tokens truncation keeps: max_length minus the special tokens
        # the post-processor adds to a single sequence (tokenizers truncates that way).
        object.__setattr__(
            self, "_content_length", max_length - tok.num_special_tokens_to_add(is_pair=False)
        )
        object.__setattr__(self, "max_length", max_length)
        object.__setattr__(self, "pad_id", pad_id)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"TextSpec is immutable (cannot set {name!r})")

    @property
    def tokenizer(self) -> Tokenizer:
        """The configured copy (padding and truncation set). Do not modify it."""
        tok: Tokenizer = self._tokenizer
        return tok

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def tokenizer_digest(self) -> str:
        """xxh3-128 of the tokenizer's canonical JSON: same vocabulary and rules,
        same digest, wherever the file came from."""
        canonical: str | None = self._canonical
        if canonical is None:
            canonical = xxhash.xxh3_128_hexdigest(_canonical_tokenizer_json(self._json).encode())
            object.__setattr__(self, "_canonical", canonical)
        return canonical

    def fingerprint_fields(self) -> dict[str, Any]:
        """Everything about this spec that changes its output."""
        return {
            "tokenizer": self.tokenizer_digest(),
            "max_length": self.max_length,
            "pad_id": self.pad_id,
            "padding": "right",
        }

    def encode(self, text: str) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """``(input_ids, attention_mask)``, both int32 ``[max_length]``. Thread-safe.

        The result is always the tokenizer's own (the whole text tokenized, then
        truncated, wrapped in the special tokens and padded), but a text longer than
        ``64 * max_length`` characters is tokenized only as far as needed: its cost
        depends on ``max_length``, not on its length (about a millisecond for 16
        tokens, for 1 MB or 100 MB), unless the text starts with a huge run without
        a word boundary (see :meth:`_encode_long`).
        """
        # One string at a time on purpose: encode_batch would start the Rayon pool
        # (see the module docstring about forked workers).
        if len(text) <= self.max_length * _PREFIX_CHARS_PER_TOKEN:
            enc = self._tokenizer.encode(text)
        else:
            enc = self._encode_long(text)
        return np.array(enc.ids, dtype=np.int32), np.array(enc.attention_mask, dtype=np.int32)

    def _encode_long(self, text: str) -> Encoding:
        """The encoding of ``text``, computed from the shortest safe prefix.

        Tokenizing everything and truncating afterwards costs seconds and hundreds
        of MB per MB of text (3 s and 0.7 GB for 4 MB: normalisation, alignment and
        offset tracking run over all of it), so one huge caption stalls a worker or
        gets it killed. A
        prefix of ``n`` characters gives the same first tokens as the whole text as
        long as the cut cannot reach them. Normalisers (NFKC, lowercase, a
        SentencePiece charsmap) and pre-tokenizers (Metaspace, ByteLevel's regex,
        BERT's whitespace/punctuation split) look only a few characters around any
        position, and the model (BPE, WordPiece, Unigram) tokenizes each
        pre-tokenized word on its own. So a cut changes at most the word it falls in
        and, through a boundary character or a lookahead (ByteLevel's ``\\s+(?!\\S)``
        gives trailing spaces to the next word), the one before. A prefix is
        therefore accepted only when the kept tokens lie in words that end at least
        two word boundaries before the cut, and at least 8 more tokens follow them
        (:func:`_prefix_is_final`); then truncating its encoding keeps exactly
        the tokens the whole text would keep, and the post-processor (``[CLS] ...
        [SEP]``) and padding run on the same tokens, so the ids and mask are
        identical. Otherwise the prefix grows 4x, up to the whole text.

        Limit: with no word boundary (a tokenizer without a pre-tokenizer, or a
        caption that starts with megabytes of text without spaces, such as a base64
        blob) no prefix is provably safe, and the prefix grows to the end of that
        run: such a caption costs what it did before (plus at most a third for the
        prefixes tried), never a wrong token.
        """
        untruncated = self._untruncated
        if untruncated is None:
            # A second copy without truncation or padding, built on the first long
            # caption only (a big vocabulary costs tens of MB). Two threads racing
            # here both build one; either serves.
            untruncated = Tokenizer.from_str(self._json)
            untruncated.no_truncation()
            untruncated.no_padding()
            object.__setattr__(self, "_untruncated", untruncated)
        n = self.max_length * _PREFIX_CHARS_PER_TOKEN
        while n < len(text):
            enc = untruncated.encode(text[:n], add_special_tokens=False)
            if _prefix_is_final(enc.word_ids, self._content_length):
                # Truncation, special tokens and padding, exactly as encode() does them
                # after tokenizing.
                return self._tokenizer.post_process(enc)
            n *= _PREFIX_GROWTH
        return self._tokenizer.encode(text)

    def __getstate__(self) -> tuple[str, int, int]:
        return (self._json, self.max_length, self.pad_id)

    def __setstate__(self, state: tuple[str, int, int]) -> None:
        tokenizer_json, max_length, pad_id = state
        self._setup(tokenizer_json, max_length, pad_id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TextSpec):
            return NotImplemented
        return self.fingerprint_fields() == other.fingerprint_fields()

    def __hash__(self) -> int:
        return hash((self.tokenizer_digest(), self.max_length, self.pad_id))

    def __repr__(self) -> str:
        return (
            f"TextSpec(tokenizer=<vocab {self.vocab_size}, {self.tokenizer_digest()[:12]}>, "
            f"max_length={self.max_length}, pad_id={self.pad_id})"
        )


def _prefix_is_final(word_ids: Sequence[int | None], keep: int) -> bool:
    """Whether the first ``keep`` tokens of a prefix's encoding are the whole text's.

    ``word_ids`` are the prefix encoding's (no special tokens): the index of the
    pre-tokenized word each token comes from. See :meth:`TextSpec._encode_long`.
    """
    if len(word_ids) < keep + _PREFIX_MARGIN_TOKENS:
        return False
    if keep == 0:  # nothing is kept: truncation drops every token, whatever they are
        return True
    kept, last = word_ids[keep - 1], word_ids[-1]
    if kept is None or last is None:  # no word information: cannot tell, grow
        return False
    return kept + _PREFIX_MARGIN_WORDS <= last


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = 4096, *, min_frequency: int = 1
) -> Tokenizer:
    """Train a small BPE tokenizer on ``texts``, offline (nothing is downloaded).

    NFKC + lowercase normalisation; SentencePiece-style word boundaries (``▁`` marks
    a word start, so decoding restores spaces); the lowercase ASCII letters, digits
    and punctuation are always in the vocabulary (no ``[UNK]`` for them); specials
    ``[PAD]`` (id 0), ``[UNK]`` (1), ``[CLS]`` (2), ``[SEP]`` (3); every encoding is
    wrapped as ``[CLS] ... [SEP]``. The vocabulary stops growing when every word of
    ``texts`` is a single token, so it can end up smaller than ``vocab_size``.

    Deterministic: the same texts give the same tokenizer JSON in any process. (BPE
    without a continuing-subword prefix on purpose: the WordPiece trainer numbers its
    ``##x`` tokens in hash-map order, which changes from run to run.) Enough for
    demos, tests and benchmarks; real training uses its model's own tokenizer.

    >>> tok = train_tokenizer(["a dog on a bench", "a cat on a mat"], vocab_size=100)
    >>> tok.encode("A dog!").tokens
    ['[CLS]', '▁a', '▁dog', '!', '[SEP]']
    """
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    _check_int("vocab_size", vocab_size, minimum=8)
    _check_int("min_frequency", min_frequency, minimum=0)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))  # noqa: S106
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(_SPECIALS),
        initial_alphabet=list(_BASE_ALPHABET),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    return tok


# ----------------------------------------------------------------------------------------------
# Pipeline
# ----------------------------------------------------------------------------------------------


class Pipeline:
    """Record -> arrays: ``{"image": uint8 [3,H,W]}`` and/or ``{"input_ids", "attention_mask"}``.

    Args:
        image: how to decode images; ``None`` for a text-only pipeline.
        text: how to tokenize captions; ``None`` for an image-only pipeline.

    At least one is required. Immutable, picklable, thread-safe (see the module
    docstring).

    >>> pipe = Pipeline(image=ImageSpec(size=64))
    >>> len(pipe.fingerprint())
    32
    """

    __slots__ = ("_fingerprint", "image", "text")

    _fingerprint: str | None
    image: ImageSpec | None
    text: TextSpec | None

    def __init__(self, image: ImageSpec | None = None, text: TextSpec | None = None) -> None:
        if image is None and text is None:
            raise ConfigError("Pipeline needs an image spec, a text spec or both")
        if image is not None and not isinstance(image, ImageSpec):
            raise ConfigError(f"Pipeline.image must be an ImageSpec, got {type(image).__name__}")
        if text is not None and not isinstance(text, TextSpec):
            raise ConfigError(f"Pipeline.text must be a TextSpec, got {type(text).__name__}")
        object.__setattr__(self, "image", image)
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "_fingerprint", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Pipeline is immutable (cannot set {name!r})")

    def __getstate__(self) -> tuple[ImageSpec | None, TextSpec | None]:
        return (self.image, self.text)

    def __setstate__(self, state: tuple[ImageSpec | None, TextSpec | None]) -> None:
        object.__setattr__(self, "image", state[0])
        object.__setattr__(self, "text", state[1])
        object.__setattr__(self, "_fingerprint", None)

    def __repr__(self) -> str:
        return f"Pipeline(image={self.image!r}, text={self.text!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Pipeline):
            return NotImplemented
        return self.fingerprint() == other.fingerprint()

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def fingerprint(self) -> str:
        """Hex digest (xxh3-128) of everything that changes this pipeline's output.

        In: image size, resize, interpolation, crop and geometry convention, draft,
        alpha background, decoder (Pillow) major version, the tokenizer's content
        (canonical JSON, not its path), max_length, pad id, and
        :data:`PIPELINE_FORMAT_VERSION`. Out: file paths, worker counts, batch sizes,
        ``max_pixels`` and ``max_bytes`` (they decide which samples fail, not what
        others contain), and
        the tokenizers library version (its output for a given tokenizer.json is
        stable). Identical across processes, runs and machines with the same Pillow
        major version.
        """
        cached: str | None = self._fingerprint
        if cached is None:
            payload = {
                "format": PIPELINE_FORMAT_VERSION,
                "image": None if self.image is None else self.image.fingerprint_fields(),
                "text": None if self.text is None else self.text.fingerprint_fields(),
            }
            blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
            cached = xxhash.xxh3_128_hexdigest(blob)
            object.__setattr__(self, "_fingerprint", cached)
        return cached

    def load_image(self, path: str | os.PathLike[str], *, sample_id: str) -> npt.NDArray[np.uint8]:
        """Decode, resize and crop one image to uint8 ``[3, size, size]``. Raises SampleError."""
        if self.image is None:
            raise ConfigError("this pipeline has no ImageSpec")
        return _load_image(self.image, path, sample_id=sample_id)

    def tokenize(self, text: str) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """``(input_ids, attention_mask)``, int32 ``[max_length]`` each."""
        if self.text is None:
            raise ConfigError("this pipeline has no TextSpec")
        return self.text.encode(text)

    def process(
        self, image_path: str | os.PathLike[str] | None, text: str | None, *, sample_id: str
    ) -> dict[str, npt.NDArray[Any]]:
        """One record -> its arrays. Inputs the pipeline has no spec for are ignored.

        Raises SampleError when the pipeline needs an image (or a caption) and the
        record has none, or when the image cannot be decoded.
        """
        # Text fields first: the codec stores fields in this order, so the small ones
        # sit next to the header and the loader reads header + tokens as one range.
        out: dict[str, npt.NDArray[Any]] = {}
        image: npt.NDArray[Any] | None = None
        if self.image is not None:
            if image_path is None:
                raise SampleError(
                    "record has no image, but the pipeline has an ImageSpec "
                    "(use Pipeline(image=None, ...) for text-only data)",
                    sample_id=sample_id,
                )
            image = _load_image(self.image, image_path, sample_id=sample_id)
        if self.text is not None:
            if text is None:
                raise SampleError(
                    "record has no text, but the pipeline has a TextSpec "
                    "(use Pipeline(text=None, ...) for image-only data)",
                    sample_id=sample_id,
                    path=None if image_path is None else os.fspath(image_path),
                )
            out["input_ids"], out["attention_mask"] = self.text.encode(text)
        if image is not None:
            out["image"] = image
        return out


# ----------------------------------------------------------------------------------------------
# Normalisation (on the training device)
# ----------------------------------------------------------------------------------------------


def normalize(
    images: torch.Tensor,
    mean: Sequence[float] = CLIP_MEAN,
    std: Sequence[float] = CLIP_STD,
) -> torch.Tensor:
    """uint8 ``[B,3,H,W]`` or ``[3,H,W]`` -> float32 ``(x / 255 - mean) / std`` on its device.

    Meant to run on the GPU after the uint8 batch has been copied there (4x less to
    copy than float32). Returns a new tensor; the input is not modified.

    >>> import torch
    >>> normalize(torch.full((3, 1, 1), 255, dtype=torch.uint8), mean=(0.5,) * 3, std=(0.5,) * 3)
    tensor([[[1.]],
    <BLANKLINE>
            [[1.]],
    <BLANKLINE>
            [[1.]]])
    """
    import torch

    if not isinstance(images, torch.Tensor):
        raise ConfigError(f"normalize expects a torch.Tensor, got {type(images).__name__}")
    if images.dtype != torch.uint8:
        raise ConfigError(f"normalize expects a uint8 tensor, got {images.dtype}")
    if images.dim() not in (3, 4) or images.shape[-3] != 3:
        raise ConfigError(f"normalize expects shape [B,3,H,W] or [3,H,W], got {list(images.shape)}")
    if len(mean) != 3 or len(std) != 3 or any(s <= 0 for s in std):
        raise ConfigError(f"mean and std need 3 values each, std > 0; got {mean!r}, {std!r}")
    mean_t = torch.tensor(mean, dtype=torch.float32, device=images.device).view(3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=images.device).view(3, 1, 1)
    return (images.to(torch.float32).div_(255.0) - mean_t).div_(std_t)
