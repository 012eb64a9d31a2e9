"""The memory tier's read check over a whole batch (issue 28: the warm path with its check).

A checked gather copies the small ranges and gaps of a batch at once and checks each
entry from the copies (``codec.checksums_match_rows``); what it serves is what it
checked. These tests pin that it finds every flipped byte wherever it lies (header,
gap, image, tokens, tail), for entries of several sizes and classes in one batch, for
targets in any order or rows, and that it does so without Python calls per entry
(the per-entry check made seven, the callback form one: the cost the warm path paid).
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from mmcache import codec
from mmcache.cache import check_reads
from mmcache.stores.memory import MemoryStore

SUM, LENGTH = codec.HEADER["checksum"], codec.HEADER["length"]


def _sample(i: int, side: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    return {
        "image": rng.integers(0, 256, (3, side, side), dtype=np.uint8),
        "input_ids": rng.integers(0, 1000, 32).astype(np.int32),
    }


def _flip(raw: bytes, i: int) -> bytes:
    b = bytearray(raw)
    b[i] ^= 0x5A
    return bytes(b)


@pytest.fixture
def store() -> Iterator[MemoryStore]:
    s = check_reads(MemoryStore(f"trc-{uuid.uuid4().hex[:12]}", capacity=1 << 24))
    try:
        yield s
    finally:
        s.unlink()


def _layout_targets(raw: bytes, n: int) -> list[tuple[int, int, np.ndarray]]:
    """The loader's ranges: header and table, the image (large), the token ids; a gap
    of alignment padding between the table and the image."""
    head = codec.read_header(raw)
    image, ids = head.fields
    return [
        (ids.offset, ids.nbytes, np.zeros((n, ids.nbytes), np.uint8)),  # out of order
        (0, head.table_end, np.zeros((n, head.table_end), np.uint8)),
        (image.offset, image.nbytes, np.zeros((n, image.nbytes), np.uint8)),
    ]


def _flip_stored(store: MemoryStore, raw: bytes, i: int) -> None:
    """Flip byte ``i`` of the one stored copy of ``raw`` in the store's data segments."""
    for path in store.segment_paths():
        with open(path, "r+b") as f:
            data = f.read()
            at = data.find(raw)
            if at >= 0:
                f.seek(at + i)
                f.write(bytes([data[at + i] ^ 0x5A]))
                return
    raise AssertionError("entry not found in the segments")


def test_batch_checksum_equals_the_entry_checksum_for_every_split_and_every_flip() -> None:
    raw = codec.encode(_sample(0, side=6))
    n = len(raw)
    arr = np.frombuffer(raw, np.uint8)
    cuts = [[n], [8, n], [12, 20, n], [24, 100, n], [SUM.offset, LENGTH.stop, 150, n]]
    for stops in cuts:
        flipped = [_flip(raw, i) for i in range(n)] + [raw]
        entries = np.frombuffer(b"".join(flipped), np.uint8).reshape(n + 1, n)
        order = np.random.default_rng(len(stops)).permutation(n + 1)  # rows in any order
        pieces: list[tuple[int, np.ndarray]] = []
        start = 0
        for k, stop in enumerate(stops):
            piece = np.zeros((n + 1, stop - start), np.uint8)
            if k % 2:  # rows not contiguous with each other (strided), as a batch view
                piece = np.zeros((n + 1, stop - start + 3), np.uint8)[:, : stop - start]
            piece[order] = entries[:, start:stop]
            pieces.append((start, piece))
            start = stop
        calls: list[int] = []
        ok = codec.checksums_match_rows(n, pieces, order.tolist(), calls.append)
        assert calls == list(range(n + 1))
        want = [codec.checksum_matches(bytes(r)) for r in entries]
        assert want == [False] * n + [True]  # every flip, the checksum's own bytes too
        assert ok.tolist() == want, stops
    assert not codec.checksums_match_rows(n + 1, [(0, np.zeros((2, n + 1), np.uint8))], [0]).any()
    with pytest.raises(ValueError, match="tile"):
        codec.checksums_match_rows(n, [(0, arr[None, :10]), (12, arr[None, 12:])], [0])
    with pytest.raises(ValueError, match="cover"):
        codec.checksums_match_rows(n, [(0, arr[None, :10])], [0])


@pytest.mark.parametrize("part", ["header", "checksum", "gap", "image", "ids"])
def test_a_flipped_byte_anywhere_in_an_entry_is_not_served(store: MemoryStore, part: str) -> None:
    raws = [codec.encode(_sample(i)) for i in range(12)]
    keys = [os.urandom(16) for _ in raws]
    for k, v in zip(keys, raws, strict=True):
        assert store.put(k, v)
    head = codec.read_header(raws[0])
    image, ids = head.fields
    at = {
        "header": LENGTH.stop + 1,
        "checksum": SUM.offset + 3,
        "gap": head.table_end + 1,
        "image": image.offset + image.nbytes // 2,
        "ids": ids.offset + 5,
    }[part]
    assert head.table_end + 1 < image.offset  # the layout has a gap
    _flip_stored(store, raws[4], at)
    _flip_stored(store, raws[9], at)
    targets = _layout_targets(raws[0], len(keys))
    found = store.gather_ranges(keys, targets)
    assert found.tolist() == [i not in (4, 9) for i in range(12)]
    assert store.stats().corrupt == 2 and not store.contains(keys[4])
    for j in np.flatnonzero(found).tolist():
        for offset, length, out in targets:
            assert bytes(out[j]) == raws[j][offset : offset + length]


def test_entries_of_several_sizes_and_classes_in_one_batch(store: MemoryStore) -> None:
    """Each (class, size) group is checked on its own; a short entry is not found; a
    layout with a long gap (only a header asked for) is checked entry by entry."""
    raws = [codec.encode(_sample(i, side=16 if i % 3 else 40)) for i in range(9)]
    raws.append(codec.encode({**_sample(99), "extra": np.arange(5, dtype=np.int64)}))
    keys = [os.urandom(16) for _ in raws]
    for k, v in zip(keys, raws, strict=True):
        assert store.put(k, v)
    _flip_stored(store, raws[3], len(raws[3]) - 7)  # a large entry's last bytes
    _flip_stored(store, raws[5], 40)  # a small one's field table
    n = len(raws[1])
    whole = np.zeros((len(keys), n), np.uint8)
    found = store.gather_ranges(keys, [(0, n, whole)])
    assert len(raws[3]) - 7 >= n  # in the tail, beyond the range asked for: checked too
    assert found.tolist() == [i not in (3, 5) for i in range(10)]
    for j in np.flatnonzero(found).tolist():
        assert bytes(whole[j]) == raws[j][:n]
    assert store.stats().corrupt == 2
    heads = np.zeros((len(keys), 24), np.uint8)  # a gap of the whole image: entry by entry
    found = store.gather_ranges(keys, [(0, 24, heads)])
    assert found.tolist() == [i not in (3, 5) for i in range(10)]
    for j in np.flatnonzero(found).tolist():
        assert bytes(heads[j]) == raws[j][:24]


def test_a_checked_gather_makes_no_python_call_per_entry(store: MemoryStore) -> None:
    """The check's bookkeeping is per batch: no Python-level call per entry (the large
    ranges' copies are handed to the check as data), a fixed number per batch. The
    per-entry check made seven per entry (the check, its helpers, a view of each
    entry), then one (a callback copying the large ranges), a cost the warm path paid
    on every hit; a count of calls is the same on a busy machine and a quiet one."""
    raws = [codec.encode(_sample(i, side=40)) for i in range(128)]  # images > 4 KiB
    keys = [os.urandom(16) for _ in raws]
    for k, v in zip(keys, raws, strict=True):
        assert store.put(k, v)

    def calls(n: int) -> int:
        targets = _layout_targets(raws[0], n)
        assert store.gather_ranges(keys[:n], targets).all()  # mapped, memoised
        count = 0

        def profile(frame: Any, event: str, arg: Any) -> None:
            nonlocal count
            count += event == "call"

        sys.setprofile(profile)
        try:
            found = store.gather_ranges(keys[:n], targets)
        finally:
            sys.setprofile(None)
        assert found.all()
        return count

    per_entry = (calls(128) - calls(64)) / 64
    assert per_entry < 0.5, per_entry
