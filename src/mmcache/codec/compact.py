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
  A video entry's frames (the ``videos`` field of
  :func:`~mmcache.transforms.video_decode.video_fields`: each clip's uint8
  ``[t, 3, h, w]`` bytes one after the other, shaped by ``video_sizes``) become one
  JPEG per frame, the same way (PSNR >= 30 dB per frame at Q=90 on the tests' clips).

The packed bytes are themselves a codec entry (a zstd frame is wrapped in one),
so every stored value carries an xxh3 checksum, checked on unpack: a damaged
compact entry raises :class:`~mmcache.errors.CorruptEntryError`, like a raw one.
Which form a disk tier holds is part of where it lives (``disk-<tag>/``, see
:class:`mmcache.cache.Cache`), so entries of two forms never mix.

Batch gathers (:meth:`DiskForm.write_ranges`, what
:meth:`mmcache.stores.disk.formed.FormedDiskStore.gather_rows` calls): bytes
``[offset, offset + length)`` of the raw entry ``unpack`` would return, written
into one row of each target without building that entry. A JPEG field is
decoded by the decoder ``unpack`` uses (the same pixels, bit for bit) into a
per-thread HWC buffer and transposed into its ``[3, H, W]`` row; the other
fields are copied; the raw header and table come from a memoised template per
layout (ctime and cost from the stored header; the checksum bytes left zero: the
gather ignores them, and no second checksum is computed, since the caller checked
the stored entry's own and a decode is deterministic). A zstd frame is
decompressed and its ranges copied.

Hostile records: a stored entry can be well formed, checksum included, and still
declare an entry far larger than itself (a 32 KiB zstd frame of 943 MiB of zeros, a
2 KiB JPEG whose header says 12000x12000). Every decode is told the size first: the
zstd frame's declared content size and the JPEG headers' dimensions (read without
decoding) are checked against the batch layout's entry length in a gather (over it: an
entry of another layout, absent there and read on its own, as a raw entry of another
shape is) and against the disk budget in :meth:`DiskForm.unpack` (over it: the entry is
:class:`~mmcache.errors.CorruptEntryError`, discarded and produced again), before
anything is allocated. A
video's frames are decoded only into the size its record's ``video_sizes`` declares:
the frame count, every frame's JPEG header and the byte lengths must all agree with it
(read without decoding), else the entry is damaged; each decode writes into its
frame's own ``3 * h * w`` bytes.

Codecs are optional: ``pip install 'mmcache[compact]'``. Pure functions but for a
bounded memo of templates and per-thread scratch buffers; thread- and
process-safe (the decoders and numpy's copies release the GIL, so several
threads decode at once).
"""

from __future__ import annotations

import functools
import io
import re
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from mmcache import codec
from mmcache.errors import ConfigError, CorruptEntryError

__all__ = ["ZSTD_LEVEL", "DiskForm", "jpeg_backend", "parse_disk_form"]

#: The zstandard level of the ``zstd`` form (see the module docstring).
ZSTD_LEVEL = 3
_ZSTD_FIELD = "\x00zstd"  # the one field of a packed zstd entry: the frame
_JPEG_PREFIX = "\x00jpeg:"  # a JPEG-packed image field: "\x00jpeg:<name>"
# A video entry's frames (transforms.video_decode.video_fields' names: the codec layer
# cannot import the transforms): "\x00jpegv:videos" holds every frame's JPEG one after
# another, "\x00jpegl:videos" (int64 [T], right after it) their byte lengths.
_VIDEOS, _VIDEO_SIZES = "videos", "video_sizes"
_FRAMES_PREFIX, _LENGTHS_PREFIX = "\x00jpegv:", "\x00jpegl:"
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
        frames = _video_frames(sample)
        for name, arr in sample.items():
            if name == _VIDEOS and frames is not None:
                jpgs = [_jpeg_encode(np.ascontiguousarray(f.transpose(1, 2, 0)), self.quality)
                        for f in frames]  # fmt: skip
                out[_FRAMES_PREFIX + name] = np.frombuffer(b"".join(jpgs), dtype=np.uint8)
                out[_LENGTHS_PREFIX + name] = np.array([len(j) for j in jpgs], dtype=np.int64)
            elif _is_image(arr) and name not in bf16:
                hwc = np.ascontiguousarray(arr.transpose(1, 2, 0))
                jpg = _jpeg_encode(hwc, self.quality)
                out[_JPEG_PREFIX + name] = np.frombuffer(jpg, dtype=np.uint8)
            else:
                out[name] = arr
        return codec.encode(out, ctime=header.ctime, cost=header.cost, bfloat16=bf16)

    def unpack(self, stored: bytes | memoryview, *, limit: int | None = None) -> bytes:
        """The entry of the stored bytes (raises CorruptEntryError if damaged).

        ``limit``: the most bytes the entry may have (the disk tier passes its budget:
        it never stores a larger entry). A stored record that declares more, in its
        zstd frame header or its JPEG headers, is damaged: refused before anything of
        that size is allocated."""
        if self.kind == "raw":
            return bytes(stored)
        header = codec.read_header(stored)
        body = codec.decode(stored, verify=True)
        if self.kind == "zstd":
            frame = _zstd_frame(body)
            declared = _zstd_declared(frame)
            _check_declared(declared, limit)
            return _zstd_decompress(frame, declared)
        bf16 = {f.name for f in header.fields if f.logical_dtype == "bfloat16"}
        plan = _jpeg_plan(body, bf16)
        _check_declared(sum(f.nbytes for f in plan), limit)
        out: dict[str, np.ndarray] = {}
        for f in plan:
            if f.fill is None:
                out[f.name] = f.arr
            else:
                buf = np.empty(f.nbytes, dtype=np.uint8)
                f.fill(buf)
                out[f.name] = buf.reshape(f.shape)
        return codec.encode(out, ctime=header.ctime, cost=header.cost, bfloat16=bf16)

    def write_ranges(
        self, stored: bytes, targets: Sequence[tuple[int, int, np.ndarray]], row: int
    ) -> bool:
        """Bytes ``[offset, offset + length)`` of ``unpack(stored)`` into row ``row`` of
        each ``(offset, length, out)`` target, without building the entry (a batch
        gather; see "Batch gathers" above); False if the entry is shorter.
        The caller has checked ``stored``'s checksum; CorruptEntryError if it does not
        decode. Not for ``raw`` (gathered as its own bytes)."""
        return _write_ranges(self, stored, targets, row)


# -- bounds: what a stored record declares, checked before it is decoded ------------


def _zstd_frame(body: dict[str, np.ndarray]) -> npt.NDArray[np.uint8]:
    frame = body.get(_ZSTD_FIELD)
    if frame is None or len(body) != 1:
        raise CorruptEntryError("not a zstd-form entry")
    return frame


def _zstd_declared(frame: npt.NDArray[np.uint8]) -> int:
    """The size the zstd frame's header declares (``pack`` always writes it)."""
    zstd = _zstd()
    try:
        size = int(zstd.frame_content_size(frame[:18].tobytes()))  # 18: the longest header
    except zstd.ZstdError as exc:
        raise CorruptEntryError(f"zstd frame header does not parse: {exc}") from None
    if size < 0:
        raise CorruptEntryError("zstd frame does not declare its size (not written by pack)")
    return size


def _zstd_decompress(frame: npt.NDArray[np.uint8], declared: int) -> bytes:
    """The frame decompressed into at most ``declared`` bytes (checked before)."""
    zstd = _zstd()
    dec = getattr(_local, "zstd", None)
    if dec is None:
        dec = _local.zstd = zstd.ZstdDecompressor()
    try:
        raw = dec.decompress(frame, max_output_size=declared)
    except zstd.ZstdError as exc:
        raise CorruptEntryError(f"zstd frame does not decompress: {exc}") from None
    if len(raw) != declared:
        raise CorruptEntryError(f"zstd frame gives {len(raw)} bytes, its header says {declared}")
    return bytes(raw)


class _Field(NamedTuple):
    """One field of the raw entry a jpeg-form body unpacks into: its layout, and how
    its bytes are made (``fill`` decodes into a uint8 buffer of ``nbytes``; ``None``:
    the stored ``arr`` is the field itself)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    bf16: bool
    nbytes: int
    arr: npt.NDArray[Any]
    fill: Callable[[npt.NDArray[np.uint8]], None] | None


def _jpeg_plan(body: dict[str, np.ndarray], bf16: set[str]) -> list[_Field]:
    """The fields ``body`` (a jpeg-form entry) unpacks into, in order, sized from the
    JPEG headers and the record's ``video_sizes`` (read without decoding; nothing of
    the declared size is allocated here). CorruptEntryError when they disagree."""
    plan: list[_Field] = []
    for name, arr in body.items():
        if name.startswith(_JPEG_PREFIX):
            h, w = _jpeg_dims(arr)
            fill = functools.partial(_decode_chw, arr, h, w)
            plan.append(_Field(name[len(_JPEG_PREFIX) :], "|u1", (3, h, w), False, 3 * h * w,
                               arr, fill))  # fmt: skip
        elif name.startswith(_FRAMES_PREFIX):
            plan.append(_frames_field(name[len(_FRAMES_PREFIX) :], arr, body))
        elif name.startswith(_LENGTHS_PREFIX) and name[len(_LENGTHS_PREFIX) :] == _VIDEOS:
            continue  # read with its frames
        elif name.startswith("\x00"):
            raise CorruptEntryError(f"unknown packed field {name!r}")
        else:
            plan.append(_Field(name, arr.dtype.str, tuple(arr.shape), name in bf16, arr.nbytes,
                               arr, None))  # fmt: skip
    return plan


def _video_frames(sample: dict[str, np.ndarray]) -> list[npt.NDArray[np.uint8]] | None:
    """A video entry's frames, each a uint8 ``[3, h, w]`` view of ``videos``, in order;
    None when ``sample`` has no video frames in that layout (they stay raw)."""
    videos, sizes = sample.get(_VIDEOS), sample.get(_VIDEO_SIZES)
    if videos is None or sizes is None or videos.dtype != np.uint8 or videos.ndim != 1:
        return None
    if sizes.ndim != 2 or sizes.shape[1] != 3 or sizes.shape[0] == 0 or sizes.dtype.kind != "i":
        return None
    dims = [(int(t), int(h), int(w)) for t, h, w in sizes.tolist()]
    if min(min(d) for d in dims) <= 0 or sum(t * 3 * h * w for t, h, w in dims) != videos.size:
        return None
    frames, at = [], 0
    for t, h, w in dims:
        for _ in range(t):
            frames.append(videos[at : at + 3 * h * w].reshape(3, h, w))
            at += 3 * h * w
    return frames


def _frames_field(name: str, blob: npt.NDArray[np.uint8], body: dict[str, np.ndarray]) -> _Field:
    """The ``videos`` field of a jpeg-form video entry, checked against the record: one
    JPEG per frame ``video_sizes`` declares, each of that frame's ``h x w``, the byte
    lengths adding up to the stored frames exactly."""
    lengths, sizes = body.get(_LENGTHS_PREFIX + name), body.get(_VIDEO_SIZES)
    if name != _VIDEOS or lengths is None or sizes is None:
        raise CorruptEntryError("a video's JPEG frames without their lengths or video_sizes")
    if sizes.ndim != 2 or sizes.shape[1] != 3 or sizes.dtype.kind != "i" or lengths.ndim != 1:
        raise CorruptEntryError(f"video_sizes of shape {sizes.shape} (not [n, 3] integers)")
    count = int(sizes[:, 0].astype(np.int64).sum())
    if sizes.size == 0 or int(sizes.min()) <= 0 or count != lengths.size:
        raise CorruptEntryError(
            f"video_sizes {sizes.tolist()[:8]} declare {count} frames, "
            f"the entry stores {lengths.size} JPEGs"
        )
    dims = [(h, w) for t, h, w in sizes.tolist() for _ in range(t)]  # as many as JPEGs
    ends = np.cumsum(lengths.astype(np.int64))
    if int(lengths.min()) <= 0 or int(ends[-1]) != blob.size:
        raise CorruptEntryError("the video's JPEG lengths do not add up to its stored frames")
    starts = ends - lengths
    jpgs = [blob[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
    for k, (jpg, hw) in enumerate(zip(jpgs, dims, strict=True)):
        if _jpeg_dims(jpg) != hw:
            raise CorruptEntryError(
                f"video frame {k}'s JPEG header says {_jpeg_dims(jpg)}, video_sizes {hw}"
            )
    nbytes = sum(3 * h * w for h, w in dims)

    def fill(dst: npt.NDArray[np.uint8]) -> None:
        at = 0
        for jpg, (h, w) in zip(jpgs, dims, strict=True):
            _decode_chw(jpg, h, w, dst[at : at + 3 * h * w])
            at += 3 * h * w

    return _Field(name, "|u1", (nbytes,), False, nbytes, blob, fill)


def _check_declared(declared: int, limit: int | None) -> None:
    if limit is not None and declared > limit:
        raise CorruptEntryError(
            f"the stored record declares an entry of {declared} bytes, over the {limit} "
            "bytes it can have (a crafted or damaged entry)"
        )


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


# -- batch gathers: the raw entry's byte ranges straight from the stored form -------

#: ``(offset, length, out)``: bytes of the raw entry into row ``row`` of ``out``.
_Target = tuple[int, int, npt.NDArray[np.uint8]]
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


def _paint(dst: npt.NDArray[np.uint8], start: int, span: tuple[int, int], src: _Field) -> None:
    """Write the field ``src``, which lies at ``span`` of the raw entry, into ``dst``
    (raw bytes from ``start`` on)."""
    offset, nbytes = span
    lo, hi = max(offset, start), min(offset + nbytes, start + dst.shape[0])
    if hi <= lo:
        return
    if lo == offset and hi == offset + nbytes:  # the whole field: straight in
        whole = dst[lo - start : hi - start]
        if src.fill is None:
            whole[...] = src.arr.reshape(-1).view(np.uint8)
        else:
            src.fill(whole)
        return
    tmp = np.empty(nbytes, dtype=np.uint8)
    if src.fill is None:
        tmp[...] = src.arr.reshape(-1).view(np.uint8)
    else:
        src.fill(tmp)
    dst[lo - start : hi - start] = tmp[lo - offset : hi - offset]


def _layout_length(targets: Sequence[_Target]) -> int:
    """The length of the batch layout's raw entries: its ranges end at the last field."""
    return max((offset + length for offset, length, _ in targets), default=0)


def _jpeg_ranges(stored: bytes, targets: Sequence[_Target], row: int) -> bool:
    header = codec.read_header(stored)
    body = codec.decode(stored, verify=False)
    bf16 = {f.name for f in header.fields if f.logical_dtype == "bfloat16"}
    plan = _jpeg_plan(body, bf16)
    # Before the template (an entry of the JPEGs' claimed size): larger than the batch's
    # entries is another layout, absent here (a varying field's entry of another shape,
    # read on its own through ``unpack``, under the disk budget; a crafted one is
    # refused there). Never allocated at the claimed size.
    if sum(f.nbytes for f in plan) > _layout_length(targets):
        return False
    spec = [(f.name, f.dtype, f.shape, f.bf16) for f in plan]
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
        for span, src in zip(tmpl.spans, plan, strict=True):
            _paint(dst, offset, span, src)
    return True


def _zstd_ranges(stored: bytes, targets: Sequence[_Target], row: int) -> bool:
    body = codec.decode(stored, verify=False)
    frame = _zstd_frame(body)
    declared = _zstd_declared(frame)
    if declared > _layout_length(targets):  # another layout (see _jpeg_ranges): absent
        return False
    src = np.frombuffer(_zstd_decompress(frame, declared), dtype=np.uint8)
    if any(offset + length > src.shape[0] for offset, length, _ in targets):
        return False
    for offset, length, out in targets:
        out[row] = src[offset : offset + length]
    return True


def _write_ranges(form: DiskForm, stored: bytes, targets: Sequence[_Target], row: int) -> bool:
    """Write each target's bytes of the raw entry of ``stored`` (an entry in ``form``,
    its checksum already checked) into row ``row`` of the target; False when the raw
    entry is shorter than a target (another layout: absent). Raises
    :class:`~mmcache.errors.CorruptEntryError` if ``stored`` does not decode."""
    if form.kind == "jpeg":
        return _jpeg_ranges(stored, targets, row)
    if form.kind == "zstd":
        return _zstd_ranges(stored, targets, row)
    raise ValueError(f"the {form} form is gathered as raw bytes")
