"""Issue 41: the memory tier's index holds more than 2**24 entries (no cap below 10**8).

Until layout version 4 an index stopped at 2**24 entries (at most 16.8% of a
10**8-sample set in memory, whatever the RAM). Its hash cells are ``int32`` holding
row + 1, so the rows they can point at go to 2**31 - 1; the tests here use rows on
both sides of 2**24 without writing 2**24 entries first: an index of 2**24 + 2
entries is a sparse tmpfs file (its rows' pages are allocated only where used), and
the entries are placed at rows 2**24 - 1, 2**24 and 2**24 + 1 by starting the free-row
search there (the header's hint and reserved-row words, as a store that held 2**24
entries would have them). What they read back goes through every path a row number
takes: the hash table (insert, lookup, rebuild by the crash repair), the reads of
this process, a new attachment and another process, and ``check()``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mmcache.errors import CacheError
from mmcache.stores.memory import MemoryStore, default_max_entries, store_dir
from mmcache.stores.memory import index as memory_index
from mmcache.stores.memory import layout as memory_layout
from mmcache.stores.memory.index import ENTRY_COLUMNS, IndexLayout, grow_target
from mmcache.stores.memory.layout import (
    H_ENTRY_HINT,
    H_HOLDER_PID,
    H_ITEMS,
    H_ROWS_RESERVED,
    H_VERSION,
    MAX_INDEX_CAPACITY,
    VERSION,
)

BOUNDARY = 1 << 24
ROWS = (BOUNDARY - 1, BOUNDARY, BOUNDARY + 1)


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def value(i: int) -> bytes:
    return i.to_bytes(8, "little") * 12  # 96 B


def test_the_index_may_hold_more_than_two_to_the_24_entries() -> None:
    """The bounds themselves: a budget of 10**8 entries of the smallest slot gets an
    index that may grow to 10**8 entries, and a grow goes past 2**24."""
    assert MAX_INDEX_CAPACITY == 2**31 - 1  # the rows an int32 hash cell can point at
    assert default_max_entries(64 * 10**8) == 10**8
    assert default_max_entries(1 << 50) == MAX_INDEX_CAPACITY
    grown = grow_target(
        entries=BOUNDARY, max_entries=10**8, items=BOUNDARY, nbytes=64 * BOUNDARY,
        capacity=64 * 10**8,
    )  # fmt: skip
    assert grown == 10**8
    # The largest index is laid out without overflow: row + 1 still fits an int32 cell.
    big = IndexLayout.build(MAX_INDEX_CAPACITY)
    assert big.entries == MAX_INDEX_CAPACITY and big.table_shift == 32
    assert big.entries + 1 <= np.iinfo(np.int32).max + 1


def test_an_index_entry_takes_under_100_bytes() -> None:
    """Bytes per entry of the index (rows and hash cells, every page touched): 83 B a
    row (93 B in version 3) and 2 to 4 cells of 4 B, so 10**8 entries take 9.4 GB."""
    row = sum(np.dtype(dtype).itemsize * int(np.prod(shape)) for _, dtype, shape in ENTRY_COLUMNS)
    assert row == 83 and row == memory_index.ROW_BYTES
    for n in (10**6, 10**8, (1 << 24) + 1, 1 << 25):
        per_entry = IndexLayout.build(n).size / n
        assert row + 8 <= per_entry <= row + 16.01 and per_entry < 100, (n, per_entry)
    assert IndexLayout.build(10**8).size < 9.4e9


def need_shm(nbytes: int) -> None:
    """Skip, naming why, when /dev/shm cannot hold an index's hash table of ``nbytes``."""
    st = os.statvfs(store_dir())
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        pytest.skip(f"/dev/shm has {free} B free; an index past 2**24 entries needs {nbytes} B")


def test_a_full_index_grows_past_two_to_the_24_entries(
    shm_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A budget of 2 GiB may index 2**25 entries of 64 B; a full first generation grows
    there in one step (the budget at the mean size seen), past the old cap."""
    need_shm(600 << 20)
    s = MemoryStore(shm_name, capacity=1 << 31, policy="lru")
    try:
        assert s.index_capacity == 1 << 25
        first = s.index_entries
        assert first == 1 << 19
        for i in range(3):
            assert s.put(key(i), value(i))
        session = s._session
        # As if the first generation held 2**19 entries of ~1 B: the next put finds the
        # index full while the bytes are free, and grows it.
        session.meta.header[H_ITEMS] = first
        with caplog.at_level(logging.INFO, logger="mmcache"):
            assert s.put(key(3), value(3))
        assert s.index_entries == 1 << 25
        assert [r for r in caplog.records if f"from {first} to {1 << 25}" in r.getMessage()]
        # The count was made up: the crash repair derives it from the rows again.
        session.meta.header[H_HOLDER_PID] = 2**22 + 1  # above pid_max: never alive
        keys = [key(i) for i in range(4)]
        assert s.get_many(keys) == [value(i) for i in range(4)]
        assert len(s) == 4 and s.check() == []
        with MemoryStore(shm_name, capacity=1 << 31, create=False) as again:
            assert again.index_entries == 1 << 25 and again.get_many(keys) == s.get_many(keys)
    finally:
        s.close()


READ_IN_ANOTHER_PROCESS = textwrap.dedent(
    """
    import sys
    from mmcache.stores.memory import MemoryStore

    name, rows = sys.argv[1], [int(r) for r in sys.argv[2:]]
    with MemoryStore(name, capacity=1 << 26, create=False) as s:
        t = s._session.table
        got = s.get_many([r.to_bytes(16, "big") for r in rows])
        ok = [g == r.to_bytes(8, "little") * 12 for g, r in zip(got, rows)]
        print(s.index_entries, sorted(t.ready_rows().tolist()) == rows, all(ok))
    """
)


def test_entries_at_rows_around_two_to_the_24_are_found_everywhere(
    shm_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    entries = BOUNDARY + 2
    need_shm(300 << 20)
    s = MemoryStore(shm_name, capacity=1 << 26, index_capacity=entries, policy="lru")
    try:
        session = s._session
        assert s.index_entries == entries
        t = session.table
        # As a store that had filled rows [0, 2**24 - 1) and freed them would look: the free
        # row search starts below the boundary. Only the pages of the rows used exist.
        for offset, length in t.index.layout.row_ranges(ROWS[0], ROWS[-1] + 1):
            t.index.seg.reserve(offset, length)
        t.header[H_ROWS_RESERVED] = ROWS[-1] + 1
        t.header[H_ENTRY_HINT] = ROWS[0]
        for r in ROWS:
            assert s.put(key(r), value(r))
        assert session.table.ready_rows().tolist() == list(ROWS)
        keys = [key(r) for r in ROWS]
        assert s.get_many(keys) == [value(r) for r in ROWS]
        assert s.contains_many(keys).all() and not s.contains(key(7))
        out = np.zeros((3, 96), np.uint8)
        assert s.gather(keys, 0, 96, out).all()
        assert [out[i].tobytes() for i in range(3)] == [value(r) for r in ROWS]
        assert s.check() == []

        # A delete leaves a tombstone over row 2**24; the key comes back at the same row.
        assert s.delete(key(BOUNDARY)) and s.get(key(BOUNDARY)) is None
        assert s.put(key(BOUNDARY), value(BOUNDARY))
        assert session.table.ready_rows().tolist() == list(ROWS)

        # The crash repair (a holder died in the lock) rebuilds the hash table from the rows.
        session.meta.header[H_HOLDER_PID] = 2**22 + 1  # above pid_max: never alive
        with caplog.at_level(logging.INFO, logger="mmcache"):
            assert s.get_many(keys) == [value(r) for r in ROWS]
        assert int(session.meta.header[H_HOLDER_PID]) == 0
        assert s.check() == [] and len(s) == 3

        # A second attachment of this process, and another process, read the same rows.
        with MemoryStore(shm_name, capacity=1 << 26, create=False) as again:
            assert again.index_entries == entries and again.get_many(keys) == s.get_many(keys)
        run = subprocess.run(
            [sys.executable, "-c", READ_IN_ANOTHER_PROCESS, shm_name, *map(str, ROWS)],
            capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == [str(entries), "True", "True"]
    finally:
        s.close()


def test_a_store_of_the_previous_layout_version_is_recreated_not_read(
    shm_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Version 3 stores (an index of at most 2**24 entries) are not this layout: an
    opener re-creates the store empty (nobody attached) and never serves their bytes."""
    assert VERSION == 4
    with MemoryStore(shm_name, capacity=1 << 20) as s:
        assert s.put(key(1), value(1))
        meta = memory_layout.meta_path(s._session.directory, shm_name)
    fd = os.open(meta, os.O_RDWR)
    try:
        os.pwrite(fd, np.int64(3).tobytes(), H_VERSION * 8)
    finally:
        os.close(fd)
    with caplog.at_level(logging.WARNING, logger="mmcache"):
        again = MemoryStore(shm_name, capacity=1 << 20)
    try:
        assert [r for r in caplog.records if "format version 3, not 4" in r.getMessage()]
        assert len(again) == 0 and again.get(key(1)) is None and again.check() == []
        assert int(again._session.meta.header[H_VERSION]) == 4
    finally:
        again.close()
    with pytest.raises(CacheError, match="format version 3"):
        fd = os.open(meta, os.O_RDWR)
        try:
            os.pwrite(fd, np.int64(3).tobytes(), H_VERSION * 8)
        finally:
            os.close(fd)
        MemoryStore(shm_name, capacity=1 << 20, create=False)
