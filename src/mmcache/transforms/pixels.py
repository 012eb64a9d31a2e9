"""Orientation, colour and geometry of a decoded image: the helpers every image stage shares.

:class:`~mmcache.transforms.image.ImageSpec` computes its crop box in the upright
frame and resamples in the stored one (:func:`crop_box`, :func:`resized_size`);
user and HF stages receive the image upright and in RGB (:func:`upright_rgb`),
which is what ``ImageOps.exif_transpose(im).convert("RGB")`` gives, except that
transparent pixels are composited on white (:data:`ALPHA_BACKGROUND`) rather than
dropped. :func:`expand_to_square` is LLaVA's ``expand2square``.

Pure functions of their arguments; thread-safe (each call has its own image objects).
"""

from __future__ import annotations

import struct

import numpy as np
from PIL import Image

from mmcache.errors import ConfigError
from mmcache.transforms.normalize import CLIP_MEAN
from mmcache.transforms.stage import ImageTraits

__all__ = [
    "ALPHA_BACKGROUND",
    "DECODE_ERRORS",
    "ORIENTATION_TRANSPOSE",
    "PAD_FILL",
    "applies_orientation",
    "checked_fill",
    "crop_box",
    "expand_to_square",
    "orientation",
    "resized_size",
    "to_rgb_or_l",
    "upright_rgb",
]

#: Colour that transparent pixels are composited on.
ALPHA_BACKGROUND: tuple[int, int, int] = (255, 255, 255)

#: The default ``ImageSpec.fill`` of ``pad_to_square``: the CLIP mean as uint8, which
#: LLaVA's ``expand2square`` pads with (``int(x * 255)``, so it normalises to ~0).
PAD_FILL: tuple[int, int, int] = (
    int(CLIP_MEAN[0] * 255),
    int(CLIP_MEAN[1] * 255),
    int(CLIP_MEAN[2] * 255),
)


def checked_fill(fill: object) -> tuple[int, int, int]:
    """``fill`` as an RGB tuple of ints 0..255 (``None``: :data:`PAD_FILL`), or ConfigError."""
    if fill is None:
        return PAD_FILL
    values = tuple(fill) if isinstance(fill, (tuple, list)) else ()
    if len(values) != 3 or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 255 for v in values
    ):
        raise ConfigError(
            f"ImageSpec.fill must be 3 ints 0..255 (an RGB colour, e.g. {PAD_FILL}), got {fill!r}"
        )
    return (values[0], values[1], values[2])


_EXIF_ORIENTATION_TAG = 0x0112
#: EXIF orientation -> the transpose that makes the image upright (as ImageOps.exif_transpose).
ORIENTATION_TRANSPOSE: dict[int, Image.Transpose] = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}

#: What Pillow raises on corrupt data, besides OSError (fuzzing finds all of these;
#: Pillow's own fuzz tests accept the same set). Anything else is a bug and propagates.
DECODE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    SyntaxError,
    ValueError,
    EOFError,
    struct.error,
    IndexError,
)

_INT16_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})


def orientation(im: Image.Image) -> int:
    """EXIF orientation 1..8 (1 when absent or unreadable).

    Call it after ``im.load()``: a PNG's ``getexif()`` decodes the pixels to reach a
    trailing ``eXIf`` chunk, and the errors swallowed here would then include a corrupt
    image's (see :func:`mmcache.transforms.image.decode_bytes`).
    """
    try:
        value = im.getexif().get(_EXIF_ORIENTATION_TAG, 1)
    except DECODE_ERRORS:
        # Broken EXIF is common in the wild and does not make the pixels unusable.
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def resized_size(width: int, height: int, resize: int, max_size: int | None) -> tuple[int, int]:
    """torchvision's ``Resize(resize, max_size=max_size)`` output size for ``width`` x ``height``.

    The shorter side becomes ``resize`` and the longer one ``int(resize * long / short)``;
    when that exceeds ``max_size``, the longer side becomes ``max_size`` and the shorter
    ``int(max_size * resize / long)`` (torchvision's ``_compute_resized_output_size``).

    >>> resized_size(640, 480, 256, None), resized_size(1000, 100, 256, 512)
    ((341, 256), (512, 51))
    """
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = resize, int(resize * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = int(max_size * new_short / new_long), max_size
    return (new_short, new_long) if width <= height else (new_long, new_short)


def crop_box(
    width: int, height: int, orientation: int, size: int, resize: int
) -> tuple[float, float, float, float]:
    """The source box (stored frame, float pixel edges) that becomes the centre crop.

    The geometry is torchvision's Resize(resize) + CenterCrop(size), evaluated in the
    upright frame (after EXIF orientation), then mapped back to the stored frame.
    """
    swapped = orientation >= 5
    uw, uh = (height, width) if swapped else (width, height)
    nw, nh = resized_size(uw, uh, resize, None)
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


def to_rgb_or_l(im: Image.Image) -> Image.Image:
    """Convert to RGB, or to L when that is exact (resampling 1 channel is 3x cheaper
    and L -> RGB afterwards is a plain copy into three channels). Transparent pixels
    are composited on :data:`ALPHA_BACKGROUND`; 16-bit greyscale is scaled to 8 bits."""
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


def upright_rgb(im: Image.Image, *, transpose: bool = True) -> Image.Image:
    """``im`` (as decoded: stored frame, any mode) upright (EXIF orientation applied)
    and in RGB (:func:`to_rgb_or_l` rules): what user and HF image stages receive.
    ``transpose=False``: as stored (the EXIF orientation ignored, as a loader without
    ``ImageOps.exif_transpose`` gives it)."""
    turn = orientation(im) if transpose else 1
    out = to_rgb_or_l(im)
    if out.mode != "RGB":
        out = out.convert("RGB")
    if turn != 1:
        out = out.transpose(ORIENTATION_TRANSPOSE[turn])
    return out


def applies_orientation(stage: object) -> bool:
    """Whether an image stage turns images upright by their EXIF orientation: its
    declared ``exif_transpose`` (the built-in stages'), True for one that declares
    nothing (a user stage receives the upright image): :class:`ImageTraits`."""
    return ImageTraits.of(stage).exif_transpose


def expand_to_square(im: Image.Image, fill: tuple[int, ...]) -> Image.Image:
    """An RGB ``im`` centred on a square canvas of ``fill`` colour (LLaVA's
    ``expand2square``: the same offsets, ``(long - short) // 2``); a square image is
    returned as is."""
    width, height = im.size
    if width == height:
        return im
    side = max(width, height)
    canvas = Image.new(im.mode, (side, side), fill)
    offset = (0, (width - height) // 2) if width > height else ((height - width) // 2, 0)
    canvas.paste(im, offset)
    return canvas
