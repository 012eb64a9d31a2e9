"""The raw-bytes tier checks a checksum on every read (G3 of the turn-3 attack).

One flipped byte of a held value inside ``raw/data.mdb`` was decoded and served, then cached
as good. Now the value is dropped (one warning naming the URL) and reads as a miss, so
``fetch_bytes`` fetches it again.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mmcache.sources.blobs.raw import RawTier, fetch_bytes

URL = "https://example.invalid/shard-00000.tar"


class _Remote:
    """Stands in for the store: serves the original bytes and counts GETs."""

    def __init__(self, data: bytes) -> None:
        self.data, self.gets = data, 0

    def read(self, url: str, start: int, end: int) -> bytes:
        self.gets += 1
        return self.data[start:end]


def _flip_in_file(path: Path, needle: bytes) -> None:
    blob = bytearray(path.read_bytes())
    at = blob.find(needle)
    assert at >= 0, "the value is not in the LMDB file"
    blob[at + len(needle) // 2] ^= 0x01
    path.write_bytes(bytes(blob))


def test_a_flipped_byte_in_the_raw_tier_is_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = bytes(range(256)) * 64
    raw = RawTier(tmp_path / "raw", budget="4MiB")
    assert raw.put(URL, "etag-1", 0, len(data), data)
    assert raw.get(URL, "etag-1", 0, len(data)) == data
    raw.close()
    _flip_in_file(tmp_path / "raw" / "data.mdb", data[1000:1100])
    raw = RawTier(tmp_path / "raw", budget="4MiB")
    with caplog.at_level(logging.WARNING):
        assert raw.get(URL, "etag-1", 0, len(data)) is None
    assert URL in caplog.text and "checksum" in caplog.text
    remote = _Remote(data)
    got = fetch_bytes(remote, raw, (URL, "etag-1", 0, len(data)), sample_id="k", wait=False)  # type: ignore[arg-type]
    assert got == data and remote.gets == 1
    assert raw.get(URL, "etag-1", 0, len(data)) == data  # kept again, intact
    raw.close()


def test_put_spans_values_are_checked_too(tmp_path: Path) -> None:
    raw = RawTier(tmp_path / "raw", budget="4MiB")
    spans = [(0, 4, b"abcd"), (4, 10, memoryview(b"efghij"))]
    assert raw.put_spans(URL, "e", spans) == [True, True]  # type: ignore[arg-type]
    assert raw.get(URL, "e", 0, 4) == b"abcd" and raw.get(URL, "e", 4, 10) == b"efghij"
    assert raw.get(URL, "e", 0, 5) is None
    raw.close()
