"""Compact forms of a cache entry for the disk tier: ``raw``, ``zstd`` and ``jpeg:Q``.

A form turns an encoded entry (:mod:`mmcache.codec`) into the bytes the disk tier
stores (:meth:`DiskForm.pack`) and back into an entry (:meth:`DiskForm.unpack`):

* ``raw``: the entry itself (the default, what the disk tier always held);
* ``zstd``: the whole entry compressed with zstandard (level 3: on this repo's
  synthetic COCO samples levels 1-12 all give ~1.23x, level 3 decodes fastest);
  lossless, so ``unpack`` returns the entry bit for bit, checksum included;
* ``jpeg:Q`` (FFCV's "jpg" write mode): every uint8 image field ``[3, H, W]`` is
  re-encoded as a JPEG of quality ``Q`` (libjpeg-turbo through ``simplejpeg``,
  which decodes these 224 px images ~1.3-3x faster than Pillow; Pillow is the
  fallback), the other fields kept as they are. **Lossy**: ``unpack`` returns a
  new entry (fresh checksum, same creation time and cost) whose image differs
  from the raw one by the JPEG error (PSNR ~35 dB at Q=90 on the synthetic set).

The packed bytes are themselves a codec entry (a zstd frame is wrapped in one),
so every stored value carries an xxh3 checksum, checked on unpack: a damaged
compact entry raises :class:`~mmcache.errors.CorruptEntryError`, like a raw one.
Which form a disk tier holds is part of where it lives (``disk-<tag>/``, see
:class:`mmcache.cache.Cache`), so entries of two forms never mix.

Codecs are optional: ``pip install 'mmcache[compact]'``. Pure functions; thread-
and process-safe.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from mmcache import codec
from mmcache.errors import ConfigError, CorruptEntryError

__all__ = ["ZSTD_LEVEL", "DiskForm", "jpeg_backend", "parse_disk_form"]

#: The zstandard level of the ``zstd`` form (see the module docstring).
ZSTD_LEVEL = 3
_ZSTD_FIELD = "\x00zstd"  # the one field of a packed zstd entry: the frame
_JPEG_PREFIX = "\x00jpeg:"  # a JPEG-packed image field: "\x00jpeg:<name>"
_FORM_RE = re.compile(r"^(raw|zstd|jpeg:(\d{1,3}))$")


def _missing(module: str, exc: ImportError) -> ConfigError:
    return ConfigError(f"disk_form needs the {module!r} package: pip install 'mmcache[compact]'")


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError as exc:
        raise _missing("zstandard", exc) from exc
    return zstandard


def jpeg_backend() -> Literal["simplejpeg", "pillow"]:
    """The JPEG codec the ``jpeg`` form uses here: simplejpeg if installed, else Pillow."""
    try:
        import simplejpeg  # noqa: F401
    except ImportError:
        return "pillow"
    return "simplejpeg"


def _jpeg_encode(hwc: np.ndarray, quality: int) -> bytes:
    if jpeg_backend() == "simplejpeg":
        import simplejpeg

        return bytes(simplejpeg.encode_jpeg(hwc, quality=quality, colorspace="RGB"))
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(hwc).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _jpeg_decode(data: bytes | np.ndarray) -> np.ndarray:
    raw = data.tobytes() if isinstance(data, np.ndarray) else data
    if jpeg_backend() == "simplejpeg":
        import simplejpeg

        return np.asarray(simplejpeg.decode_jpeg(raw, colorspace="RGB"))
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))


def _is_image(arr: np.ndarray) -> bool:
    return arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[0] == 3 and min(arr.shape[1:]) > 0


@dataclass(frozen=True)
class DiskForm:
    """One form: ``kind`` and, for ``jpeg``, the ``quality``. ``tag``: its folder suffix."""

    kind: Literal["raw", "zstd", "jpeg"]
    quality: int = 0

    @property
    def tag(self) -> str:
        return f"jpeg{self.quality}" if self.kind == "jpeg" else self.kind

    @property
    def lossless(self) -> bool:
        return self.kind != "jpeg"

    def __str__(self) -> str:
        return f"jpeg:{self.quality}" if self.kind == "jpeg" else self.kind

    def pack(self, raw: bytes | memoryview) -> bytes:
        """The bytes the disk tier stores for the entry ``raw``."""
        if self.kind == "raw":
            return bytes(raw)
        header = codec.read_header(raw)
        if self.kind == "zstd":
            zstd = _zstd()
            frame = zstd.ZstdCompressor(level=ZSTD_LEVEL).compress(bytes(raw))
            body = {_ZSTD_FIELD: np.frombuffer(frame, dtype=np.uint8)}
            return codec.encode(body, ctime=header.ctime, cost=header.cost)
        sample = codec.decode(raw, verify=False)
        out: dict[str, np.ndarray] = {}
        bf16 = {f.name for f in header.fields if f.logical_dtype == "bfloat16"}
        for name, arr in sample.items():
            if _is_image(arr) and name not in bf16:
                hwc = np.ascontiguousarray(arr.transpose(1, 2, 0))
                jpg = _jpeg_encode(hwc, self.quality)
                out[_JPEG_PREFIX + name] = np.frombuffer(jpg, dtype=np.uint8)
            else:
                out[name] = arr
        return codec.encode(out, ctime=header.ctime, cost=header.cost, bfloat16=bf16)

    def unpack(self, stored: bytes | memoryview) -> bytes:
        """The entry of the stored bytes (raises CorruptEntryError if damaged)."""
        if self.kind == "raw":
            return bytes(stored)
        header = codec.read_header(stored)
        body = codec.decode(stored, verify=True)
        if self.kind == "zstd":
            frame = body.get(_ZSTD_FIELD)
            if frame is None or len(body) != 1:
                raise CorruptEntryError("not a zstd-form entry")
            zstd = _zstd()
            try:
                return bytes(zstd.ZstdDecompressor().decompress(frame.tobytes()))
            except zstd.ZstdError as exc:
                raise CorruptEntryError(f"zstd frame does not decompress: {exc}") from None
        out: dict[str, np.ndarray] = {}
        bf16 = {f.name for f in header.fields if f.logical_dtype == "bfloat16"}
        for name, arr in body.items():
            if name.startswith(_JPEG_PREFIX):
                try:
                    hwc = _jpeg_decode(arr)
                except Exception as exc:  # any decoder error: a damaged entry
                    raise CorruptEntryError(f"JPEG field does not decode: {exc}") from None
                out[name[len(_JPEG_PREFIX) :]] = np.ascontiguousarray(hwc.transpose(2, 0, 1))
            elif name.startswith("\x00"):
                raise CorruptEntryError(f"unknown packed field {name!r}")
            else:
                out[name] = arr
        return codec.encode(out, ctime=header.ctime, cost=header.cost, bfloat16=bf16)

    def write_ranges(
        self, stored: bytes, targets: Sequence[tuple[int, int, np.ndarray]], row: int
    ) -> bool:
        """Bytes ``[offset, offset + length)`` of ``unpack(stored)`` into row ``row`` of
        each ``(offset, length, out)`` target, without building the entry (a batch
        gather; :mod:`mmcache.codec.compact_read`); False if the entry is shorter.
        The caller has checked ``stored``'s checksum; CorruptEntryError if it does not
        decode. Not for ``raw`` (gathered as its own bytes)."""
        from mmcache.codec.compact_read import write_ranges

        return write_ranges(self, stored, targets, row)


def parse_disk_form(form: str | DiskForm) -> DiskForm:
    """``"raw"``, ``"zstd"`` or ``"jpeg:Q"`` (1 <= Q <= 100) as a :class:`DiskForm`;
    ConfigError otherwise, or when the form's codec is not installed."""
    if isinstance(form, DiskForm):
        return form
    m = _FORM_RE.match(form) if isinstance(form, str) else None
    if m is None:
        raise ConfigError(f"disk_form must be 'raw', 'zstd' or 'jpeg:Q' (1-100), got {form!r}")
    if m.group(1) == "raw":
        return DiskForm("raw")
    if m.group(1) == "zstd":
        _zstd()
        return DiskForm("zstd")
    q = int(m.group(2))
    if not 1 <= q <= 100:
        raise ConfigError(f"disk_form 'jpeg:Q' needs 1 <= Q <= 100, got {form!r}")
    return DiskForm("jpeg", q)
