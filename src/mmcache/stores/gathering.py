"""``TieredReader``: one :class:`~mmcache.stores.base.BatchReader` over several, fastest first.

What ``Cache.reader`` hands the loader when more than one tier can gather
batches in the training process (memory, then disk): a batch's ranges are
gathered from the first tier, then what it lacked from the next one, and so
on, so the loader never names a tier and planning sends to the workers only
the keys no tier holds. :meth:`TieredReader.gather_from` also says which tier
served each row (the per-tier hit counts).

Ahead of use (the workers call these while planning a batch, in the epoch's
order): :meth:`TieredReader.prefetch` asks the lower tiers to read ahead the
pages of the entries the first tier lacks, and :meth:`TieredReader.promotable`
names the entries worth copying into the first tier (held only below, while
the first tier has room for them: promotion never evicts, so it cannot churn
the first tier under any policy; what the first tier's policy admits it keeps).

Thread/process safety: as the tiers (each locks itself); no state of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from mmcache.stores.base import BatchReader, GathersRows, Keys, ReadsAhead, Store

__all__ = [
    "TieredReader",
    "count_served",
    "gather_sources",
    "reader_capacity",
    "reader_names",
    "reader_stores",
]


class TieredReader:
    """A :class:`~mmcache.stores.base.BatchReader` over ``tiers`` (fastest first), each
    a :class:`~mmcache.stores.base.Store` that is itself a BatchReader.

    ``name`` is the first tier's; :attr:`names` and :attr:`stores` list them all.
    """

    supports_gather = True

    def __init__(self, tiers: Sequence[Store]) -> None:
        if not tiers:
            raise ValueError("a TieredReader needs at least one tier")
        for t in tiers:
            if not (t.supports_gather and isinstance(t, BatchReader)):
                raise TypeError(f"the {t.name} tier cannot gather batches")
        self.stores: tuple[Store, ...] = tuple(tiers)
        self._readers: tuple[Any, ...] = tuple(tiers)
        self.names: tuple[str, ...] = tuple(t.name for t in tiers)
        self.name = self.names[0]
        self._smallest = 0  # the smallest entry size promotable() has seen, 0: none yet

    def __repr__(self) -> str:
        return f"TieredReader({list(self.names)})"

    def capacity(self) -> int:
        """The largest budget of the tiers: how much of a data set it can serve."""
        return max(t.capacity() for t in self.stores)

    def gather_from(
        self,
        keys: Keys,
        targets: Sequence[tuple[int, int, npt.NDArray[np.uint8]]],
        *,
        count: bool = True,
    ) -> npt.NDArray[np.int8]:
        """Gather like :meth:`gather_ranges`; per key, the index (into :attr:`names`) of
        the tier that served it, ``-1`` where none holds it."""
        arr = _keys_array(keys)
        n = arr.shape[0]
        tier = np.full(n, -1, dtype=np.int8)
        if n == 0:
            return tier
        first = self._readers[0]
        tier[np.asarray(first.gather_ranges(arr, targets, count=count), dtype=bool)] = 0
        for i, reader in enumerate(self._readers[1:], start=1):
            left = np.flatnonzero(tier < 0)
            if not left.shape[0]:
                break
            got = _gather_rows(reader, arr[left], left, targets, count=count)
            tier[left[got]] = i
        return tier

    def gather_ranges(
        self,
        keys: Keys,
        targets: Sequence[tuple[int, int, npt.NDArray[np.uint8]]],
        *,
        count: bool = True,
    ) -> npt.NDArray[np.bool_]:
        """:meth:`~mmcache.stores.base.BatchReader.gather_ranges` over every tier."""
        return self.gather_from(keys, targets, count=count) >= 0

    def contains_many(self, keys: Keys) -> npt.NDArray[np.bool_]:
        """Whether any tier holds each key (no hit/miss counted)."""
        if isinstance(keys, (list, tuple)) and len(keys) == 1 and isinstance(keys[0], bytes):
            # One key (a worker's check of each miss): each tier's single-key probe.
            return np.array([any(bool(r.contains_many(keys)[0]) for r in self._readers)])
        arr = _keys_array(keys)
        held = np.zeros(arr.shape[0], dtype=bool)
        for reader in self._readers:
            left = np.flatnonzero(~held)
            if not left.shape[0]:
                break
            held[left] = np.asarray(reader.contains_many(arr[left]), dtype=bool)
        return held

    def count_reads(self, *, hits: int = 0, misses: int = 0) -> None:
        """Count on the first tier (:meth:`count_served` counts per tier)."""
        self._readers[0].count_reads(hits=hits, misses=misses)

    def count_served(self, tiers: npt.NDArray[np.int8]) -> None:
        """Count the hits of rows served by ``tiers`` (from :meth:`gather_from` with
        ``count=False``): one hit in the tier that served each row."""
        for i, reader in enumerate(self._readers):
            k = int((tiers == i).sum())
            if k:
                reader.count_reads(hits=k)

    def prefetch(self, keys: Keys) -> int:
        """Have the lower tiers read ahead the entries the first tier lacks (their
        ``prefetch``); the bytes they read."""
        arr = _keys_array(keys)
        if len(self._readers) < 2 or not arr.shape[0]:
            return 0
        left = arr[~np.asarray(self._readers[0].contains_many(arr), dtype=bool)]
        asked = 0
        for reader in self._readers[1:]:
            if isinstance(reader, ReadsAhead) and left.shape[0]:
                asked += int(reader.prefetch(left))
        return asked

    def promotable(self, keys: Keys) -> list[bytes]:
        """The keys held by a lower tier but not the first, as many as fit in the first
        tier's free room (promotion never evicts). Promote them with the cache's
        verified read (``Cache.lookup``), which offers each to the first tier's policy.

        Cheap when the first tier is full: once an entry was seen, a room smaller than
        the smallest entry seen answers at once (the read-ahead asks this for every
        chunk of every batch; looking each key up below cost ~20-35 µs a sample)."""
        arr = _keys_array(keys)
        if len(self._readers) < 2 or not arr.shape[0]:
            return []
        first = self.stores[0]
        room = first.capacity() - first.nbytes()
        if room <= 0 or room < self._smallest:
            return []
        idx = np.flatnonzero(~np.asarray(self._readers[0].contains_many(arr), dtype=bool))
        out: list[bytes] = []
        for j in idx.tolist():
            if room < self._smallest:
                break
            key = arr[j].tobytes()
            for store in self.stores[1:]:
                info = store.info(key)
                if info is None:
                    continue
                self._smallest = min(self._smallest or info.size, info.size)
                if info.size <= room:
                    out.append(key)
                    room -= info.size
                break
        return out


def _keys_array(keys: Keys) -> npt.NDArray[np.uint8]:
    if isinstance(keys, np.ndarray):
        return keys
    return np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), -1)


def _gather_rows(
    reader: Any,
    keys: npt.NDArray[np.uint8],
    rows: npt.NDArray[np.int64],
    targets: Sequence[tuple[int, int, npt.NDArray[np.uint8]]],
    *,
    count: bool,
) -> npt.NDArray[np.bool_]:
    """Gather ``keys`` into rows ``rows`` of ``targets``: straight in when the reader can
    (:class:`~mmcache.stores.base.GathersRows`), else into temporaries copied over."""
    if isinstance(reader, GathersRows):
        return np.asarray(reader.gather_rows(keys, rows, targets, count=count), dtype=bool)
    temps = [(off, length, np.empty((len(keys), length), np.uint8)) for off, length, _ in targets]
    got = np.asarray(reader.gather_ranges(keys, temps, count=count), dtype=bool)
    for (_, _, out), (_, _, tmp) in zip(targets, temps, strict=True):
        out[rows[got]] = tmp[got]
    return got


def gather_sources(
    reader: BatchReader,
    keys: Keys,
    targets: Sequence[tuple[int, int, npt.NDArray[np.uint8]]],
    *,
    count: bool,
) -> npt.NDArray[np.int8]:
    """Gather from any BatchReader; per key the index into :func:`reader_names` of the
    tier that served it (``-1``: absent)."""
    if isinstance(reader, TieredReader):
        return reader.gather_from(keys, targets, count=count)
    found = np.asarray(reader.gather_ranges(keys, targets, count=count), dtype=bool)
    return np.where(found, 0, -1).astype(np.int8)


def reader_names(reader: BatchReader) -> tuple[str, ...]:
    """The names of the tiers behind ``reader``, fastest first."""
    return reader.names if isinstance(reader, TieredReader) else (reader.name,)


def reader_stores(reader: BatchReader) -> tuple[Any, ...]:
    """The tiers behind ``reader`` (as Stores when they are), fastest first."""
    return reader.stores if isinstance(reader, TieredReader) else (reader,)


def reader_capacity(reader: BatchReader) -> int:
    """The largest budget of the tiers behind ``reader``: how much of a data set it serves."""
    return max(int(store.capacity()) for store in reader_stores(reader))


def count_served(reader: BatchReader, tiers: npt.NDArray[np.int8]) -> None:
    """Count the hits of rows gathered with ``count=False``, each in the tier that served
    it (``tiers``: from :func:`gather_sources`; ``-1``: not served, not counted)."""
    if isinstance(reader, TieredReader):
        reader.count_served(tiers)
    else:
        reader.count_reads(hits=int((tiers == 0).sum()))
