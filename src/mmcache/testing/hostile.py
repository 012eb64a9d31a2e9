"""Hostile inputs as test material: crafted tar headers, image headers that lie about
their size, and :class:`HostileInputContract`, the part of the source contract that
every source runs with them.

The promise checked (DESIGN: "hostile bytes are bounded before they are read"): a
sample whose bytes are hostile is, under ``on_error="raise"``, a
:class:`~mmcache.errors.SampleError` naming the sample, and under ``"skip"`` left out
and listed by ``rejects()``; never a hang, never an allocation larger than
``ImageSpec.max_bytes`` plus a small constant. The allocation is measured with
:mod:`tracemalloc` (Python and numpy allocations), as a ratio of the hostile size.

It is part of :class:`~mmcache.testing.source_contract.SourceContract`: a source's
contract class that implements :meth:`HostileInputContract.make_hostile_source` runs it
(the sources that read containers, shards and Parquet files, where a header can lie);
one that does not sees these tests skipped, naming it::

    class TestMySource(SourceContract):
        __test__ = True

        def make_hostile_source(self, images, *, pipeline, on_error):
            return MySource(write_samples(self.root, images), pipeline=pipeline,
                            on_error=on_error)

It can also be run on its own (``class TestMyHostile(HostileInputContract)``).

The crafting helpers (:func:`tar_header`, :func:`hostile_shard`, :func:`bomb_png`) build
the bytes in memory; nothing is downloaded.
"""

from __future__ import annotations

import io
import struct
import tracemalloc
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from mmcache.errors import SampleError
from mmcache.sources.base import OnError, SampleSource

__all__ = [
    "HOSTILE_SHARDS",
    "HostileInputContract",
    "bomb_png",
    "hostile_shard",
    "small_jpeg",
    "tar_header",
    "tar_member",
]

_BLOCK = 512
TiB = 1 << 40


def _number(value: int, width: int) -> bytes:
    """A tar numeric field: octal when it fits, else GNU base-256 (negative ones too)."""
    digits = width - 1
    if 0 <= value < 8**digits:
        return b"%0*o\0" % (digits, value)
    if value < 0:
        value += 256 ** (width - 1)
        return b"\xff" + value.to_bytes(width - 1, "big")
    return b"\x80" + value.to_bytes(width - 1, "big")


def tar_header(name: str, size: int, *, kind: bytes = b"0") -> bytes:
    """One 512-byte ustar header for ``name`` declaring ``size`` bytes (any int: negative
    or past 8 GiB in base-256) of type ``kind`` (``b"0"`` a file, ``b"L"`` a GNU long
    name, ``b"x"`` a PAX header), with a valid checksum: only its numbers lie."""
    buf = bytearray(_BLOCK)
    raw = name.encode()[:100]
    buf[0 : len(raw)] = raw
    buf[100:108] = b"0000644\0"
    buf[108:116] = b"0000000\0"
    buf[116:124] = b"0000000\0"
    buf[124:136] = _number(size, 12)
    buf[136:148] = b"00000000000\0"
    buf[156:157] = kind
    buf[257:265] = b"ustar\x0000"
    buf[148:156] = b" " * 8
    buf[148:156] = b"%06o\0 " % sum(buf)
    return bytes(buf)


def tar_member(name: str, data: bytes, *, kind: bytes = b"0") -> bytes:
    """A well-formed member: its header and its data padded to whole blocks."""
    pad = -len(data) % _BLOCK
    return tar_header(name, len(data), kind=kind) + data + b"\0" * pad


def small_jpeg(index: int = 0, size: int = 24) -> bytes:
    """A small, valid JPEG (its colour set by ``index``)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (size, size), (index * 40 % 256, 90, 160)).save(out, "JPEG", quality=90)
    return out.getvalue()


def bomb_png(width: int = 20000, height: int = 20000) -> bytes:
    """A PNG of a few hundred bytes whose header says ``width`` x ``height`` (a
    decompression bomb: Pillow refuses it from the header; decoding it would need
    ``width * height * 3`` bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 1024)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _good(n: int) -> bytes:
    return b"".join(
        tar_member(f"{i:06d}.jpg", small_jpeg(i)) + tar_member(f"{i:06d}.txt", b"a caption")
        for i in range(n)
    )


#: Shards whose headers lie, by name: each is two good samples, then the hostile header
#: (at byte offset ``HOSTILE_AT``), then whatever it claims to cover.
HOSTILE_SHARDS: dict[str, Callable[[], bytes]] = {
    "negative size": lambda: _good(2) + tar_header("000009.jpg", -512) + b"\0" * 2048,
    "GNU long name of 1 TiB": lambda: (
        _good(2) + tar_header("././@LongLink", TiB, kind=b"L") + b"A" * 4096
    ),
    "PAX header of 1 TiB": lambda: (
        _good(2) + tar_header("./PaxHeaders/x", TiB, kind=b"x") + b"A" * 4096
    ),
    "negative GNU long name": lambda: (
        _good(2) + tar_header("././@LongLink", -1024, kind=b"L") + b"A" * 4096
    ),
    "negative PAX size record": lambda: (
        _good(2)
        + tar_member("./PaxHeaders/x", b"15 size=-10240\n", kind=b"x")
        + tar_header("000009.jpg", 0)
        + b"\0" * 2048
    ),
}
#: Where the hostile header of every :data:`HOSTILE_SHARDS` shard starts.
HOSTILE_AT = len(_good(2))


def hostile_shard(name: str) -> bytes:
    """The bytes of :data:`HOSTILE_SHARDS` ``[name]``."""
    return HOSTILE_SHARDS[name]()


def peak_allocation(fn: Callable[[], Any]) -> tuple[int, Any, BaseException | None]:
    """``(peak bytes allocated, result, exception)`` of ``fn()`` under tracemalloc."""
    tracemalloc.start()
    try:
        try:
            result, error = fn(), None
        except Exception as exc:
            result, error = None, exc
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, result, error


class HostileInputContract:
    """Hostile image bytes through a source (see the module docstring); subclasses
    provide :meth:`make_hostile_source` (without it, its tests are skipped). Its members
    are named ``hostile_*`` so as to sit inside a source's contract class."""

    __test__ = False

    #: The pipeline's ``ImageSpec.max_bytes`` in these tests, and the size of the
    #: oversized image (the peak allocation must stay far below it).
    hostile_max_bytes = 64 << 10
    hostile_oversized = 16 << 20

    def make_hostile_source(
        self, images: Sequence[bytes], *, pipeline: Any, on_error: OnError
    ) -> SampleSource:
        """A source whose sample ``i`` has the image bytes ``images[i]`` (and any
        caption), processed by ``pipeline`` (image only)."""
        raise NotImplementedError

    def hostile_pipeline(self) -> Any:
        from mmcache.transforms import ImageSpec
        from mmcache.transforms.pipeline import Pipeline

        return Pipeline(image=ImageSpec(size=16, max_bytes=self.hostile_max_bytes), text=None)

    def _hostile_source(self, hostile: bytes, on_error: OnError) -> SampleSource:
        if type(self).make_hostile_source is HostileInputContract.make_hostile_source:
            pytest.skip(f"{type(self).__name__} has no make_hostile_source: no hostile inputs")
        images = [small_jpeg(0), hostile, small_jpeg(2)]
        return self.make_hostile_source(images, pipeline=self.hostile_pipeline(), on_error=on_error)

    def _hostile_oversized(self) -> bytes:
        return small_jpeg(1) + b"\0" * self.hostile_oversized

    def test_oversized_image_is_refused_before_it_is_read(self) -> None:
        source = self._hostile_source(self._hostile_oversized(), "raise")
        bad = source.sample_id(1)
        assert source.produce(0) and source.produce(2)  # clients and decoders warmed up
        peak, _, error = peak_allocation(lambda: source.produce(1))
        assert isinstance(error, SampleError), error
        assert error.sample_id == bad and "max_bytes" in error.reason
        assert peak < self.hostile_oversized // 8, f"{peak} bytes allocated to refuse it"

    @pytest.mark.parametrize(
        "hostile",
        [
            pytest.param(bomb_png, id="decompression bomb header"),
            pytest.param(lambda: b"\xff\xd8\xff not a JPEG at all" * 8, id="garbage"),
        ],
    )
    def test_hostile_image_is_the_samples_error(self, hostile: Callable[[], bytes]) -> None:
        source = self._hostile_source(hostile(), "raise")
        assert source.produce(0)  # clients and decoders warmed up
        peak, _, error = peak_allocation(lambda: source.produce(1))
        assert isinstance(error, SampleError) and error.sample_id == source.sample_id(1), error
        # decoding the bomb would take 1.2 GB; a fetch's client buffers take a few MiB
        assert peak < self.hostile_oversized, f"{peak} bytes allocated to refuse it"

    def test_skip_leaves_hostile_samples_out_and_lists_them(self) -> None:
        for hostile in (self._hostile_oversized(), bomb_png()):
            source = self._hostile_source(hostile, "skip")
            assert source.on_error == "skip"
            produced = []
            for i in range(len(source)):  # what the loader does with each sample
                try:
                    produced.append(bool(source.produce(i)))
                except SampleError as err:
                    source.record_reject(err)
                    produced.append(False)
            assert produced == [True, False, True]
            listed = [r.sample_id for r in source.rejects()]  # type: ignore[attr-defined]
            assert listed == [source.sample_id(1)]
