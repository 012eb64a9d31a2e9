"""The share's index files and the merged index: every field of an index bounded before
anything is fetched, a damaged index skipped whole (logged once), one row per key with
the newest copy winning, and no Python object per entry."""

from __future__ import annotations

import logging
import struct

import numpy as np
import pytest
import xxhash
from shared_writer_child import entry, key

from mmcache.errors import CorruptEntryError
from mmcache.shared import SharedTier
from mmcache.shared.index import MergedIndex, split_keys
from mmcache.shared.layout import (
    MAX_ENTRY,
    IndexArrays,
    decode_index,
    encode_index,
    index_name,
    new_pack_name,
)


def arrays(first: int, n: int, *, size: int = 100, pack_bytes: int | None = None) -> IndexArrays:
    keys = np.frombuffer(b"".join(key(i) for i in range(first, first + n)), np.uint8)
    return IndexArrays(
        keys=keys.reshape(n, 16),
        offset=np.arange(n, dtype=np.uint64) * size,
        size=np.full(n, size, np.uint32),
        ctime=np.arange(n, dtype=np.float64),
        cost=np.zeros(n, np.float32),
        pack_bytes=n * size if pack_bytes is None else pack_bytes,
        created=1.0,
    )


def resealed(data: bytes) -> bytes:
    """``data`` with its trailing checksum made right again (a hostile, not a rotten, file)."""
    body = data[:-8]
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def test_an_index_round_trips():
    a = arrays(5, 7)
    b = decode_index(encode_index(a), name="x")
    assert np.array_equal(a.keys, b.keys) and np.array_equal(a.offset, b.offset)
    assert (b.pack_bytes, b.newest, len(b)) == (700, 6.0, 7)


@pytest.mark.parametrize(
    "damage",
    ["truncated", "flipped", "outside the pack", "entry too large", "count lies"],
)
def test_a_damaged_or_hostile_index_is_refused(damage):
    data = bytearray(encode_index(arrays(0, 4)))
    if damage == "truncated":
        data = data[:-9]
    elif damage == "flipped":
        data[40] ^= 1
    elif damage == "outside the pack":
        a = arrays(0, 4, pack_bytes=350)  # the last entry ends at 400
        data = bytearray(encode_index(a))
    elif damage == "entry too large":
        a = arrays(0, 1, size=100)
        big = IndexArrays(
            a.keys,
            a.offset,
            np.array([MAX_ENTRY + 1], np.uint32),
            a.ctime,
            a.cost,
            pack_bytes=2 * MAX_ENTRY,
            created=1.0,
        )
        data = bytearray(encode_index(big))
    else:  # a count that would make a reader allocate for 2^40 entries
        data[16:24] = struct.pack("<Q", 1 << 40)
        data = bytearray(resealed(bytes(data)))
    with pytest.raises(CorruptEntryError, match="shared index x"):
        decode_index(bytes(data), name="x")


def test_a_hostile_index_is_skipped_whole_and_logged_once(tmp_path, caplog):
    share = tmp_path / "share"
    good = SharedTier(share, linger=0)
    good.put(key(1), entry(1))
    good.close()
    pack = new_pack_name()
    hostile = arrays(100, 1, size=100, pack_bytes=50)  # an entry past its pack's end
    (share / index_name(pack)).write_bytes(encode_index(hostile))
    reader = SharedTier(share, publish=False)
    with caplog.at_level(logging.ERROR):
        assert reader.get(key(1)) == entry(1)
        assert reader.get(key(100)) is None
        reader.refresh()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and pack in errors[0]  # once, naming the pack
    reader.close()


def test_the_merged_index_keeps_one_row_per_key_the_newest():
    merged = MergedIndex()
    assert merged.add([("p1", arrays(0, 100)), ("p2", arrays(50, 100))]) == 150
    hi, lo = split_keys([key(i) for i in (0, 75, 149, 150)])
    rows = merged.find(hi, lo)
    assert rows[-1] == -1 and (rows[:3] >= 0).all()
    packs = [merged.packs[int(merged.rows.pack[r])] for r in rows[:3]]
    assert packs == ["p1", "p2", "p2"]  # 75: in both, the later pack's copy
    merged.hide(int(rows[1]))
    assert merged.find(hi[1:2], lo[1:2])[0] == -1
    merged.add([("p3", arrays(75, 1))])  # produced again after damage: found again
    assert merged.find(hi[1:2], lo[1:2])[0] >= 0
    assert merged.drop_packs(["p1"]) == 50 and merged.count() == 100
    # columns of fixed dtypes, nothing per entry
    assert all(isinstance(c, np.ndarray) for c in merged.rows.columns().values())
    assert sum(c.itemsize for c in merged.rows.columns().values()) == 45  # 44 B + hidden


def test_a_million_entries_merge_and_are_found_in_batches():
    n = 1_000_000
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    big = IndexArrays(
        keys,
        np.zeros(n, np.uint64),
        np.ones(n, np.uint32),
        np.zeros(n),
        np.zeros(n, np.float32),
        pack_bytes=1,
        created=1.0,
    )
    merged = MergedIndex()
    assert merged.add([("p", big)]) == n
    hi, lo = split_keys(keys[::1000])
    assert (merged.find(hi, lo) >= 0).all()
    assert merged.rows.hi.nbytes + merged.rows.lo.nbytes == 16 * n
