"""Write byte ranges of an entry's raw form straight from its compact stored form.

What a batch gather from a compact disk tier needs
(:meth:`mmcache.stores.disk.formed.FormedDiskStore.gather_rows`): bytes
``[offset, offset + length)`` of the raw entry that
:meth:`~mmcache.codec.compact.DiskForm.unpack` would return, for each target,
written into one row of each target, without building that entry:

* ``jpeg:Q``: each JPEG field is decoded by the decoder ``unpack`` uses (so the
  same pixels, bit for bit) into a per-thread HWC buffer and transposed into its
  ``[3, H, W]`` row; the other fields are copied. The raw entry's header and
  field table come from a memoised template per layout (ctime and cost from the
  stored header; its checksum bytes are left zero: the gather ignores them, and
  no second checksum is computed, since the stored entry's own was checked
  before and a decode is deterministic);
* ``zstd``: the frame is decompressed (the raw entry, bit for bit) and its
  ranges copied.

The caller checks the stored entry's checksum first; a structural or decoder
error raises :class:`~mmcache.errors.CorruptEntryError`.

Thread safety: pure but for a bounded memo of templates (``lru_cache``) and
per-thread scratch buffers; the JPEG decode, the zstd decompression and numpy's
copies release the GIL, so several threads decode entries at once.
"""

from __future__ import annotations

import functools
import struct
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from mmcache import codec
from mmcache.codec.compact import (
    _JPEG_PREFIX,
    _ZSTD_FIELD,
    DiskForm,
    _jpeg_decode,
    _zstd,
    jpeg_backend,
)
from mmcache.errors import CorruptEntryError

__all__ = ["write_ranges"]

#: ``(offset, length, out)``: bytes of the raw entry into row ``row`` of ``out``.
Target = tuple[int, int, npt.NDArray[np.uint8]]
_TIMES = struct.Struct("<dd")  # ctime, cost: adjacent in the header
_TIMES_AT = codec.HEADER["ctime"].offset
_local = threading.local()


class _Template(NamedTuple):
    head: bytes  # the raw entry's bytes [0, table_end), times and checksum zero
    spans: tuple[tuple[int, int], ...]  # (offset, nbytes) of each field, in order
    length: int


# (name, dtype str, shape, bfloat16) per field: a layout of raw entries.
_Spec = tuple[tuple[str, str, tuple[int, ...], bool], ...]


@functools.lru_cache(maxsize=64)
def _template(spec: _Spec) -> _Template:
    sample = {name: np.zeros(shape, dtype=np.dtype(dt)) for name, dt, shape, _ in spec}
    raw = codec.encode(sample, bfloat16={name for name, _, _, bf in spec if bf})
    header = codec.read_header(raw)
    return _Template(
        head=raw[: header.table_end],
        spans=tuple((f.offset, f.nbytes) for f in header.fields),
        length=header.length,
    )


def _scratch(nbytes: int) -> npt.NDArray[np.uint8]:
    buf: npt.NDArray[np.uint8] | None = getattr(_local, "hwc", None)
    if buf is None or buf.shape[0] < nbytes:
        buf = np.empty(nbytes, dtype=np.uint8)
        _local.hwc = buf
    return buf[:nbytes]


def _jpeg_dims(data: npt.NDArray[np.uint8]) -> tuple[int, int]:
    try:
        if jpeg_backend() == "simplejpeg":
            import simplejpeg

            h, w, _, _ = simplejpeg.decode_jpeg_header(data)
            return int(h), int(w)
        import io

        from PIL import Image

        w, h = Image.open(io.BytesIO(data.tobytes())).size
        return int(h), int(w)
    except Exception as exc:  # any decoder error: a damaged entry
        raise CorruptEntryError(f"JPEG field does not decode: {exc}") from None


def _decode_chw(data: npt.NDArray[np.uint8], h: int, w: int, dst: npt.NDArray[np.uint8]) -> None:
    """Decode the JPEG ``data`` into ``dst`` (``uint8 [3 * h * w]``, CHW)."""
    try:
        if jpeg_backend() == "simplejpeg":
            import simplejpeg

            hwc = simplejpeg.decode_jpeg(data, colorspace="RGB", buffer=_scratch(h * w * 3))
        else:
            hwc = _jpeg_decode(data)
    except Exception as exc:  # any decoder error: a damaged entry
        raise CorruptEntryError(f"JPEG field does not decode: {exc}") from None
    if hwc.shape != (h, w, 3):
        raise CorruptEntryError(f"JPEG field decodes to {hwc.shape}, its header says {(h, w, 3)}")
    np.copyto(dst.reshape(3, h, w), hwc.transpose(2, 0, 1))


def _paint(
    dst: npt.NDArray[np.uint8],
    start: int,
    span: tuple[int, int],
    src: tuple[npt.NDArray[Any], tuple[int, int] | None],
) -> None:
    """Write the field ``src`` (its stored array; its JPEG dims, None if copied), which
    lies at ``span`` of the raw entry, into ``dst`` (raw bytes from ``start`` on)."""
    offset, nbytes = span
    lo, hi = max(offset, start), min(offset + nbytes, start + dst.shape[0])
    if hi <= lo:
        return
    arr, dims = src
    if lo == offset and hi == offset + nbytes:  # the whole field: straight in
        whole = dst[lo - start : hi - start]
        if dims is None:
            whole[...] = arr.reshape(-1).view(np.uint8)
        else:
            _decode_chw(arr, dims[0], dims[1], whole)
        return
    tmp = np.empty(nbytes, dtype=np.uint8)
    if dims is None:
        tmp[...] = arr.reshape(-1).view(np.uint8)
    else:
        _decode_chw(arr, dims[0], dims[1], tmp)
    dst[lo - start : hi - start] = tmp[lo - offset : hi - offset]


def _jpeg_ranges(stored: bytes, targets: Sequence[Target], row: int) -> bool:
    header = codec.read_header(stored)
    body = codec.decode(stored, verify=False)
    bf16 = {f.name for f in header.fields if f.logical_dtype == "bfloat16"}
    spec: list[tuple[str, str, tuple[int, ...], bool]] = []
    srcs: list[tuple[npt.NDArray[Any], tuple[int, int] | None]] = []
    for name, arr in body.items():
        if name.startswith(_JPEG_PREFIX):
            h, w = _jpeg_dims(arr)
            spec.append((name[len(_JPEG_PREFIX) :], "|u1", (3, h, w), False))
            srcs.append((arr, (h, w)))
        elif name.startswith("\x00"):
            raise CorruptEntryError(f"unknown packed field {name!r}")
        else:
            spec.append((name, arr.dtype.str, tuple(arr.shape), name in bf16))
            srcs.append((arr, None))
    tmpl = _template(tuple(spec))
    if any(offset + length > tmpl.length for offset, length, _ in targets):
        return False  # another layout than the batch's: absent
    head = bytearray(tmpl.head)
    _TIMES.pack_into(head, _TIMES_AT, header.ctime, header.cost)
    head_arr = np.frombuffer(head, dtype=np.uint8)
    for offset, length, out in targets:
        dst = out[row]
        stop = offset + length
        exact = any(span == (offset, length) for span in tmpl.spans)
        if not exact:
            dst[...] = 0  # the alignment padding between fields
            if offset < len(head):
                dst[: min(len(head), stop) - offset] = head_arr[offset : min(len(head), stop)]
        for span, src in zip(tmpl.spans, srcs, strict=True):
            _paint(dst, offset, span, src)
    return True


def _zstd_ranges(stored: bytes, targets: Sequence[Target], row: int) -> bool:
    body = codec.decode(stored, verify=False)
    frame = body.get(_ZSTD_FIELD)
    if frame is None or len(body) != 1:
        raise CorruptEntryError("not a zstd-form entry")
    zstd = _zstd()
    dec = getattr(_local, "zstd", None)
    if dec is None:
        dec = _local.zstd = zstd.ZstdDecompressor()
    try:
        raw = dec.decompress(frame)
    except zstd.ZstdError as exc:
        raise CorruptEntryError(f"zstd frame does not decompress: {exc}") from None
    src = np.frombuffer(raw, dtype=np.uint8)
    if any(offset + length > src.shape[0] for offset, length, _ in targets):
        return False
    for offset, length, out in targets:
        out[row] = src[offset : offset + length]
    return True


def write_ranges(form: DiskForm, stored: bytes, targets: Sequence[Target], row: int) -> bool:
    """Write each target's bytes of the raw entry of ``stored`` (an entry in ``form``,
    its checksum already checked) into row ``row`` of the target; False when the raw
    entry is shorter than a target (another layout: absent). Raises
    :class:`~mmcache.errors.CorruptEntryError` if ``stored`` does not decode."""
    if form.kind == "jpeg":
        return _jpeg_ranges(stored, targets, row)
    if form.kind == "zstd":
        return _zstd_ranges(stored, targets, row)
    raise ValueError(f"the {form} form is gathered as raw bytes")
