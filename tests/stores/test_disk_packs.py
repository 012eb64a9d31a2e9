"""Packs of the disk tier (``stores/disk/packs.py``): small entries of one write
transaction in one LMDB value, at ~1.0x their size, with every promise of the tier kept."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import struct
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest

from mmcache.errors import CacheError
from mmcache.stores.disk import DiskStore
from mmcache.stores.disk.env import Txn

BATCH = 64  # what the write-behind hands put_many at most (MAX_PENDING)


def _key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def _value(i: int, size: int = 1024) -> bytes:
    """A deterministic value of ``size`` bytes ending with its own checksum."""
    body = (hashlib.sha256(i.to_bytes(8, "little")).digest() * (size // 32 + 1))[: size - 8]
    return body + hashlib.blake2b(body, digest_size=8).digest()


def _check(blob: bytes | memoryview) -> bool:
    blob = bytes(blob)
    return hashlib.blake2b(blob[:-8], digest_size=8).digest() == blob[-8:]


def _put_batches(store: DiskStore, ids: list[int], size: int = 1024) -> None:
    for start in range(0, len(ids), BATCH):
        rows = [(_key(i), _value(i, size), 0.0, 0.0) for i in ids[start : start + BATCH]]
        assert all(store.put_many(rows))


def _env(path: Path) -> lmdb.Environment:
    return lmdb.open(str(path), max_dbs=8, lock=False)


def _used(path: Path) -> int:
    """Bytes of data.mdb LMDB has used: up to its last page (free pages included)."""
    with _env(path) as env:
        return int((env.info()["last_pgno"] + 1) * env.stat()["psize"])


def _entries(path: Path, name: bytes) -> int:
    with _env(path) as env:
        db = env.open_db(name, create=False)
        with env.begin() as txn:
            return int(txn.stat(db)["entries"])


def _open_stats(store: DiskStore) -> tuple[int, int, int]:
    """``(slots, bytes of all packs, bytes of data.mdb used)`` of an open store."""
    h = store._env()
    with Txn(h) as txn:
        slots = int(txn.stat(h.slots)["entries"])
        pack_bytes = sum(len(v) for _k, v in txn.cursor(db=h.packs))
    env = h.require()
    return slots, pack_bytes, int((env.info()["last_pgno"] + 1) * env.stat()["psize"])


def test_1kb_entries_in_random_key_order_take_at_most_1_3x_their_size(tmp_path: Path) -> None:
    """20,000 entries of 1 KiB (keys in random order, as digests are): 2.2x before packs."""
    path = tmp_path / "c"
    n = 20_000
    with DiskStore(path, capacity=64 << 20, policy="fifo") as store:
        _put_batches(store, list(range(n)))
        assert len(store) == n and store.nbytes() == n * 1024
        for i in random.Random(1).sample(range(n), 200):
            assert store.get(_key(i)) == _value(i)
    ratio = _used(path) / (n * 1024)
    assert ratio <= 1.3, f"data.mdb uses {ratio:.2f}x the payload"


def test_deletes_and_evictions_of_packed_entries_free_their_space_for_reuse(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c"
    n = 4_000
    rng = random.Random(2)
    with DiskStore(path, capacity=n * 1024, policy="fifo") as store:
        _put_batches(store, list(range(n)))
        slots, _pack_bytes, full = _open_stats(store)
        assert slots == n  # every entry packed
        gone = rng.sample(range(n), 3 * n // 4)
        for i in gone:
            assert store.delete(_key(i))
        kept = sorted(set(range(n)) - set(gone))
        # Packs below half live were rewritten or deleted: the dead bytes left in
        # packs never exceed the live ones.
        _slots, pack_bytes, _used_now = _open_stats(store)
        assert pack_bytes <= 2 * len(kept) * 1024 + 64 * 1024
        # Filling the budget again (evicting in fifo order) reuses the freed pages.
        _put_batches(store, list(range(n, 2 * n)))
        assert store.nbytes() <= n * 1024
        assert store.stats().evictions > 0
        for i in kept[:50] + list(range(2 * n - 50, 2 * n)):
            got = store.get(_key(i))
            assert got is None or got == _value(i)
        assert store.verify(_check) == []
        assert len(list(store.keys())) == len(store)
    # Without reuse the refill alone would add its n KiB to the file.
    assert _used(path) < full + 0.75 * n * 1024


def _writer(path: str, start: int) -> None:
    """Write batches of packed entries until killed."""
    with DiskStore(path, capacity=256 << 20, policy="fifo") as store:
        i = start
        while True:
            rows = [(_key(j), _value(j, 700 + j % 900), 0.0, 0.0) for j in range(i, i + BATCH)]
            store.put_many(rows)
            i += BATCH


def test_kill_9_during_packed_writes_leaves_only_committed_verified_entries(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c"
    DiskStore(path, capacity=256 << 20).close()
    ctx = mp.get_context("spawn")
    rng = random.Random(3)
    start = 0
    seen: set[bytes] = set()
    for _round in range(2):
        proc = ctx.Process(target=_writer, args=(str(path), start))
        proc.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until it has committed a few batches
            with DiskStore(path, capacity=256 << 20, policy="fifo") as store:
                if len(store) > len(seen) + 4 * BATCH:
                    break
            time.sleep(0.05)
        time.sleep(rng.random() * 0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
        with DiskStore(path, capacity=256 << 20, policy="fifo") as store:
            assert store.verify(_check) == []
            keys = set(store.keys())
            assert len(keys) == len(store) > len(seen)
            seen = keys
            for j in range(start, start + len(keys)):
                got = store.get(_key(j))
                if got is not None:
                    assert got == _value(j, 700 + j % 900)
            assert store.nbytes() == sum(store.info(k).size for k in keys)  # type: ignore[union-attr]
            start += 100_000
    assert _entries(path, b"slots") > 0


def test_a_corrupt_packed_entry_is_detected_and_never_served(tmp_path: Path) -> None:
    path = tmp_path / "c"
    with DiskStore(path, capacity=1 << 20) as store:
        _put_batches(store, list(range(BATCH)))
        assert store.verify(_check) == []
    with _env(path) as env:  # bypass the store: flip a byte of entry 5 inside its pack
        slots, packs = env.open_db(b"slots", create=False), env.open_db(b"packs", create=False)
        with env.begin(write=True) as txn:
            pack_id, offset, _length = struct.unpack("<QII", txn.get(_key(5), db=slots))
            pid = pack_id.to_bytes(8, "big")
            pack = bytearray(txn.get(pid, db=packs))
            pack[offset + 100] ^= 0xFF
            txn.put(pid, bytes(pack), db=packs)
            # and entry 6's slot points past the end of its pack
            txn.put(_key(6), struct.pack("<QII", pack_id, len(pack), 1024), db=slots)
    with DiskStore(path, capacity=1 << 20) as store:
        assert sorted(store.verify(_check)) == sorted([_key(5), _key(6)])
        store.enable_gather(_check)
        out = np.zeros((3, 1024), dtype=np.uint8)
        found = store.gather_ranges([_key(4), _key(5), _key(7)], [(0, 1024, out)])
        assert found.tolist() == [True, False, True]  # 5 discarded, counted corrupt
        assert bytes(out[2]) == _value(7)
        assert store.get(_key(5)) is None and store.stats().corrupt >= 3
        assert store.rebuild_totals() == ((BATCH - 2) * 1024, BATCH - 2)  # 6 removed
        assert store.verify(_check) == []
        with store.view(_key(7)) as buf:  # a zero-copy slice of its pack
            assert isinstance(buf, memoryview) and bytes(buf) == _value(7)


def test_compact_and_salvage_keep_packed_entries_packed(tmp_path: Path) -> None:
    path = tmp_path / "c"
    with DiskStore(path, capacity=8 << 20) as store:
        _put_batches(store, list(range(1000)))
        for i in range(0, 1000, 3):
            store.delete(_key(i))
        store.compact()
        assert store.verify(_check) == []
        report = store.salvage()
        assert report.kept == len(store) == 1000 - 334
        assert store.verify(_check) == []
        assert all(store.get(_key(i)) == _value(i) for i in range(1, 1000, 3))
    assert _entries(path, b"slots") == 1000 - 334


def _format_1_store(path: Path) -> None:
    """A disk cache as format 1 wrote it: data, meta, info; one entry."""
    path.mkdir()
    with lmdb.open(str(path), max_dbs=3) as env:
        data, meta, info = (env.open_db(n) for n in (b"data", b"meta", b"info"))
        with env.begin(write=True) as txn:
            txn.put(b"format", struct.pack("<8sHH", b"MMCDISK\x00", 1, 0), db=info)
            txn.put(b"totals", struct.pack("<qqqq", 1024, 1, 1, 1), db=info)
            txn.put(_key(1), _value(1), db=data)
            txn.put(_key(1), struct.pack("<qdddqq", 1024, 0.0, 1.0, 1.0, 0, 0), db=meta)


def test_a_format_1_store_is_upgraded_by_a_writable_open_never_misread(tmp_path: Path) -> None:
    path = tmp_path / "c"
    _format_1_store(path)
    with pytest.raises(CacheError, match="format 1"):
        DiskStore(path, capacity=1 << 20, readonly=True)
    with DiskStore(path, capacity=1 << 20) as store:
        assert store.get(_key(1)) == _value(1)
        _put_batches(store, list(range(2, 2 + BATCH)))
        assert store.verify(_check) == []
    with _env(path) as env:
        info = env.open_db(b"info", create=False)
        with env.begin() as txn:
            assert struct.unpack("<8sHH", txn.get(b"format", db=info))[1:] == (2, 0)
    with DiskStore(path, capacity=1 << 20, readonly=True) as store:
        assert len(store) == 1 + BATCH and store.get(_key(1)) == _value(1)
