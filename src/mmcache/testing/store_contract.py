"""The contract every :class:`~mmcache.stores.base.Store` must pass, as a pytest base class.

Subclass it in a test module, set ``__test__ = True`` and implement
:meth:`StoreContract.make_store` (and :meth:`StoreContract.reopen` for a tier
that persists)::

    class TestMyStore(StoreContract):
        __test__ = True

        @pytest.fixture(autouse=True)
        def _where(self, tmp_path):
            self.root = tmp_path

        def make_store(self, capacity, policy="lru"):
            return MyStore(self.root / uuid.uuid4().hex, capacity=capacity, policy=policy)

Every store the suite makes is closed after its test. The tests are small
(a few hundred bytes of data each) so a store runs the whole suite in seconds.
Pair it with :func:`mmcache.testing.store_machine.make_store_machine`, which
checks the same rules on random operation sequences.

A store without a byte budget of its own (``Store.bounded = False``: the shared
tier) skips the tests of the budget and its policies, and nothing else.

Rules checked beyond the method docstrings of the ABC: ``get`` returns
``bytes`` that stay valid whatever happens next; a refused ``put`` never leaves
an older value of the same key readable (a new value for a key means the old one
is stale); ``nbytes`` is exactly the sum of the sizes held; ``contains``,
``info``, ``keys`` and ``len`` never count hits or misses; a flipped byte of a
stored entry is never served, by a read or a batch gather (the read checks the cache
installs, :func:`mmcache.cache.check_reads`), for a store whose test says how to
flip one (:meth:`StoreContract.flip_stored_byte`). The declared surface
(:mod:`mmcache.stores.base`): ``put_many`` does what ``put`` does row by row, claims a
store offers exclude each other, and a store that declares a sub-protocol
(:class:`~mmcache.stores.base.ChecksEntries`, :class:`~mmcache.stores.base.ReadsAhead`,
:class:`~mmcache.stores.base.GathersRows`, :class:`~mmcache.stores.base.Salvages`) answers it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from mmcache import codec
from mmcache.cache import check_reads
from mmcache.errors import CorruptEntryError
from mmcache.stats import TierStats
from mmcache.stores.base import (
    KEY_SIZE,
    BatchReader,
    ChecksEntries,
    GathersRows,
    ReadsAhead,
    Salvages,
    Store,
)
from mmcache.stores.tiered import Accepted, Tier, TieredStore

__all__ = ["StoreContract", "flip_in_files", "key"]

#: Sleep between events whose order a policy must see (coarse clocks tie otherwise).
_TICK = 0.005


def key(i: int) -> bytes:
    """A valid 16-byte store key made from a small integer."""
    return i.to_bytes(KEY_SIZE, "big")


def _value(i: int, size: int) -> bytes:
    return bytes((i + j) % 251 for j in range(size))


class StoreContract:
    """Contract tests for a :class:`Store`; subclasses provide the store."""

    __test__ = False

    def make_store(self, capacity: int, policy: str = "lru") -> Store:
        """Return a new, empty store with this byte budget and policy."""
        raise NotImplementedError

    def reopen(self, store: Store) -> Store | None:
        """Close ``store`` and open its data again; None if the tier does not persist."""
        return None

    def flip_stored_byte(self, store: Store, k: bytes, value: bytes) -> bool:
        """Flip one byte of the image of the entry ``value`` stored under ``k`` where the
        tier keeps it (its shared segment, its file), as a stray write or rot would,
        the store staying open; False if nothing of it lives outside the process (the
        flipped-byte test is then skipped). :func:`flip_in_files` does it for files."""
        return False

    # ------------------------------------------------------------------ plumbing

    @pytest.fixture(autouse=True)
    def _close_stores(self) -> Iterator[None]:
        self._made: list[Store] = []
        yield
        for store in self._made:
            store.close()

    def _store(self, capacity: int = 1000, policy: str = "lru") -> Store:
        store = self.make_store(capacity, policy)
        self._made.append(store)
        return store

    def _bounded(self, capacity: int = 1000, policy: str = "lru") -> Store:
        """A store for a test of the budget and its policy; skipped for a store that
        declares it has none (``Store.bounded = False``: the shared tier)."""
        store = self._store(capacity, policy)
        if not store.bounded:
            pytest.skip(f"{type(store).__name__} keeps no byte budget of its own (bounded=False)")
        return store

    @staticmethod
    def _held(store: Store) -> int:
        total = 0
        for k in store.keys():  # noqa: SIM118 - a Store is not iterable
            info = store.info(k)
            assert info is not None, "keys() lists a key that info() does not know"
            total += info.size
        return total

    # ------------------------------------------------------------------ basics

    def test_put_get_roundtrip(self) -> None:
        store = self._store()
        value = _value(1, 100)
        assert store.put(key(1), value) is True
        got = store.get(key(1))
        assert isinstance(got, bytes)
        assert got == value

    def test_get_missing_is_none(self) -> None:
        store = self._store()
        store.put(key(1), b"x")
        assert store.get(key(2)) is None

    def test_put_accepts_memoryview(self) -> None:
        store = self._store()
        value = _value(2, 64)
        assert store.put(key(1), memoryview(value))
        assert store.get(key(1)) == value

    def test_get_copy_stays_valid(self) -> None:
        store = self._store(capacity=400)
        first = _value(1, 200)
        store.put(key(1), first)
        got = store.get(key(1))
        store.put(key(1), _value(9, 200))  # overwrite
        for i in range(2, 10):  # and evict everything
            store.put(key(i), _value(i, 200))
        store.delete(key(1))
        assert got == first

    def test_view_equals_value(self) -> None:
        store = self._store()
        value = _value(3, 300)
        store.put(key(1), value)
        with store.view(key(1)) as buf:
            assert buf is not None
            assert bytes(buf) == value
            assert len(buf) == len(value)
        with store.view(key(2)) as missing:
            assert missing is None

    def test_empty_value(self) -> None:
        store = self._store()
        assert store.put(key(1), b"") is True
        assert store.get(key(1)) == b""
        assert store.contains(key(1))
        info = store.info(key(1))
        assert info is not None
        assert info.size == 0
        assert store.nbytes() == 0

    def test_overwrite_replaces(self) -> None:
        store = self._store()
        store.put(key(1), _value(1, 100))
        assert store.put(key(1), _value(2, 30))
        assert store.get(key(1)) == _value(2, 30)
        assert store.nbytes() == 30
        assert len(store) == 1

    def test_delete(self) -> None:
        store = self._store()
        store.put(key(1), _value(1, 100))
        store.put(key(2), _value(2, 50))
        assert store.delete(key(1)) is True
        assert store.delete(key(1)) is False
        assert store.get(key(1)) is None
        assert not store.contains(key(1))
        assert store.nbytes() == 50
        assert store.get(key(2)) == _value(2, 50)

    def test_contains_and_in(self) -> None:
        store = self._store()
        store.put(key(1), b"abc")
        assert store.contains(key(1))
        assert not store.contains(key(2))
        assert key(1) in store
        assert key(2) not in store
        assert "not bytes" not in store
        stats = store.stats()
        assert (stats.hits, stats.misses) == (0, 0)

    def test_info(self) -> None:
        store = self._store()
        store.put(key(1), _value(1, 123), cost=0.25, ctime=1234.5)
        info = store.info(key(1))
        assert info is not None
        assert (info.size, info.cost, info.ctime) == (123, 0.25, 1234.5)
        assert store.info(key(2)) is None
        stats = store.stats()
        assert (stats.hits, stats.misses) == (0, 0)

    def test_keys_and_len(self) -> None:
        store = self._store()
        for i in range(1, 4):
            store.put(key(i), _value(i, 10))
        assert sorted(store.keys()) == [key(1), key(2), key(3)]
        assert len(store) == 3
        store.delete(key(2))
        assert sorted(store.keys()) == [key(1), key(3)]
        assert len(store) == 2

    def test_nbytes_is_sum_of_sizes(self) -> None:
        store = self._store(capacity=10_000)
        sizes = [0, 1, 17, 255, 1000, 3]
        for i, size in enumerate(sizes):
            store.put(key(i), _value(i, size))
        assert store.nbytes() == sum(sizes)
        assert self._held(store) == sum(sizes)
        assert store.capacity() == (10_000 if store.bounded else 2**63 - 1)

    # ------------------------------------------------------------------ budget and policies

    def test_budget_holds_with_eviction(self) -> None:
        store = self._bounded(capacity=1000, policy="lru")
        for i in range(120):
            assert store.put(key(i % 40), _value(i, (i * 37) % 400))
            assert store.nbytes() <= 1000
        assert store.nbytes() == self._held(store)
        assert store.stats().evictions > 0

    def test_budget_holds_with_refusal(self) -> None:
        store = self._bounded(capacity=1000, policy="keep")
        results = [store.put(key(i), _value(i, (i * 37) % 400)) for i in range(60)]
        assert store.nbytes() <= 1000
        assert store.nbytes() == self._held(store)
        assert not all(results)
        assert store.stats().refused == results.count(False)
        assert store.stats().evictions == 0

    def test_oversize_refused_and_counted(self) -> None:
        store = self._bounded(capacity=100)
        assert store.put(key(1), _value(1, 101)) is False
        assert not store.contains(key(1))
        assert store.nbytes() == 0
        stats = store.stats()
        assert (stats.puts, stats.admitted, stats.refused) == (1, 0, 1)
        assert store.put(key(2), _value(2, 100)) is True  # exactly the budget fits

    def test_refused_put_never_serves_older_value(self) -> None:
        store = self._bounded(capacity=100)
        store.put(key(1), _value(1, 50))
        assert store.put(key(1), _value(2, 500)) is False
        assert store.get(key(1)) is None
        assert store.nbytes() == 0

    def test_keep_refuses_when_full(self) -> None:
        store = self._bounded(capacity=300, policy="keep")
        for i in range(3):
            assert store.put(key(i), _value(i, 100))
        assert store.put(key(3), _value(3, 100)) is False
        assert sorted(store.keys()) == [key(0), key(1), key(2)]
        assert store.get(key(3)) is None

    def test_lru_evicts_least_recently_read(self) -> None:
        store = self._bounded(capacity=400, policy="lru")
        for i in range(4):
            store.put(key(i), _value(i, 100))
            time.sleep(_TICK)
        assert store.get(key(0)) is not None  # 0 is now the most recently read
        time.sleep(_TICK)
        assert store.put(key(4), _value(4, 100))
        assert sorted(store.keys()) == [key(0), key(2), key(3), key(4)]
        assert store.stats().evictions == 1

    def test_expire_removes_exactly_old_entries(self) -> None:
        store = self._store()
        for i, ctime in enumerate([10.0, 20.0, 30.0]):
            store.put(key(i), _value(i, 10), ctime=ctime)
        assert store.expire(25.0) == 2
        assert sorted(store.keys()) == [key(2)]
        assert store.nbytes() == 10
        assert store.expire(25.0) == 0
        assert store.expire(30.0) == 0  # strictly older only
        assert store.stats().expired == 2

    def test_stats_count_events(self) -> None:
        store = self._bounded(capacity=300, policy="lru")
        for i in range(4):  # the 4th put evicts one entry
            store.put(key(i), _value(i, 100))
        store.put(key(9), _value(9, 301))  # refused
        store.get(key(3))
        store.get(key(3))
        store.get(key(0))  # evicted: a miss
        stats = store.stats()
        assert isinstance(stats, TierStats)
        assert (stats.puts, stats.admitted, stats.refused) == (5, 4, 1)
        assert (stats.hits, stats.misses, stats.evictions) == (2, 1, 1)
        assert (stats.bytes, stats.items, stats.budget) == (300, 3, 300)

    # ------------------------------------------------------------------ lifecycle and errors

    def test_close_is_idempotent(self) -> None:
        store = self._store()
        store.put(key(1), b"x")
        store.close()
        store.close()

    def test_context_manager_closes(self) -> None:
        with self._store() as store:
            store.put(key(1), b"x")
            assert store.get(key(1)) == b"x"

    @pytest.mark.parametrize(
        ("bad", "error"),
        [("0123456789abcdef", TypeError), (b"short", ValueError), (bytearray(16), TypeError)],
    )
    def test_bad_keys_raise(self, bad: object, error: type[Exception]) -> None:
        store = self._store()
        calls: list[Callable[[], object]] = [
            lambda: store.get(bad),  # type: ignore[arg-type]
            lambda: store.put(bad, b"x"),  # type: ignore[arg-type]
            lambda: store.delete(bad),  # type: ignore[arg-type]
            lambda: store.contains(bad),  # type: ignore[arg-type]
            lambda: store.info(bad),  # type: ignore[arg-type]
        ]
        for call in calls:
            with pytest.raises(error):
                call()

    def test_reopen_keeps_entries(self) -> None:
        store = self._store()
        store.put(key(1), _value(1, 100), cost=0.5, ctime=7.0)
        store.put(key(2), _value(2, 50))
        reopened = self.reopen(store)
        if reopened is None:
            pytest.skip("this tier does not persist")
        self._made.append(reopened)
        assert reopened.get(key(1)) == _value(1, 100)
        assert reopened.get(key(2)) == _value(2, 50)
        assert reopened.nbytes() == 150
        assert len(reopened) == 2
        info = reopened.info(key(1))
        assert info is not None
        assert (info.cost, info.ctime) == (0.5, 7.0)

    # ------------------------------------------------------------------ declared surface

    def test_put_many_does_what_put_does_row_by_row(self) -> None:
        store = self._store()
        rows = [(key(i), _value(i, 40), 0.25, 3.0) for i in range(3)]
        assert store.put_many(rows) == [True, True, True]
        for k, value, _, _ in rows:
            assert store.get(k) == value
            info = store.info(k)
            assert info is not None and (info.cost, info.ctime) == (0.25, 3.0)
        assert store.put_many([]) == []

    def test_claims_a_store_offers_exclude_each_other(self) -> None:
        claims = self._store().claims()
        if claims is None:
            return  # the default: no claims here (a cache then produces unclaimed)
        first = claims.acquire(key(1), wait=False)
        assert first is not None and first.fd >= 0 and not first.waited
        try:
            second = claims.acquire(key(1), wait=False)
            assert second is not None and second.fd < 0 and second.waited  # held: a pass
        finally:
            first.release()
        again = claims.acquire(key(1), wait=False)
        assert again is not None and again.fd >= 0
        again.release()

    def test_a_declared_sub_protocol_is_answered(self) -> None:
        store = check_reads(self._store(capacity=1 << 20))
        good = _entry(1)
        assert store.put(key(1), good)
        if isinstance(store, ChecksEntries):
            assert store.verify(codec.verify) == []  # a good entry passes its own check
            assert store.stats().corrupt == 0
        if isinstance(store, ReadsAhead):
            assert int(store.prefetch([key(1)])) >= 0
        if isinstance(store, Salvages):
            assert store.tree_problem() is None
        if isinstance(store, GathersRows) and store.supports_gather:  # (formed: its form's)
            out = np.zeros((2, 8), dtype=np.uint8)
            found = store.gather_rows([key(1)], np.array([1]), [(0, 8, out)])
            assert found.tolist() == [True] and bytes(out[1]) == good[:8]

    # ------------------------------------------------------------------ integrity

    def test_a_flipped_byte_is_never_served(self) -> None:
        """Issue 24: a flipped byte in any tier is never served. The entry is dropped,
        counted ``corrupt``, and reads as absent (the caller produces it again), by the
        tier list's read (what ``Cache.get`` runs) and by a batch gather."""
        store = check_reads(self._store(capacity=1 << 20))
        value = _entry(1)
        assert store.put(key(1), value)
        if not self.flip_stored_byte(store, key(1), value):
            pytest.skip("this tier keeps nothing outside the process")
        tiers = store if isinstance(store, TieredStore) else TieredStore([Tier(store)])
        assert tiers.lookup(key(1), _decoded) is None
        assert not store.contains(key(1))
        if not isinstance(store, TieredStore):
            assert store.stats().corrupt == 1
        if not (store.supports_gather and isinstance(store, BatchReader)):
            return
        value = _entry(2)
        assert store.put(key(2), value) and store.put(key(3), _entry(3))
        assert self.flip_stored_byte(store, key(2), value)
        out = np.zeros((2, len(value)), dtype=np.uint8)
        found = store.gather_ranges([key(2), key(3)], [(0, len(value), out)])
        assert found.tolist() == [False, True]
        assert bytes(out[1]) == _entry(3)
        assert not store.contains(key(2)) and store.stats().corrupt == 2


def _entry(i: int) -> bytes:
    """A codec entry whose image is ``i``'s pseudo-random bytes (unique in the store)."""
    rng = np.random.default_rng(i)
    return codec.encode(
        {
            "image": rng.integers(0, 256, (3, 32, 32), dtype=np.uint8),
            "input_ids": np.arange(16, dtype=np.int32),
        }
    )


def _decoded(raw: bytes, verify: bool) -> Accepted[object]:
    """The cache's read check, verifying (the cache verifies every tier's reads)."""
    if not codec.verify(raw):
        raise CorruptEntryError("checksum mismatch")
    return Accepted(raw, 0.0, 0.0)


def flip_in_files(paths: list[str], needle: bytes) -> None:
    """Flip one byte in the middle of every copy of ``needle`` in ``paths``.

    Every copy, not the first: a store may keep stale copies of an entry's bytes beside
    the live one (LMDB's copy-on-write leaves freed pages holding old values), and
    which copy is live is the store's business."""
    flipped = 0
    for path in paths:
        data = _read(path)
        at = data.find(needle)
        if at < 0:
            continue
        with open(path, "r+b") as f:
            while at >= 0:
                f.seek(at + len(needle) // 2)
                f.write(bytes([data[at + len(needle) // 2] ^ 0x5A]))
                flipped += 1
                at = data.find(needle, at + 1)
    assert flipped, f"the entry's bytes are in none of {paths}"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
