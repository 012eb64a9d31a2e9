"""The disk tier as a :class:`~mmcache.stores.base.BatchReader`: batches gathered from LMDB's map.

LMDB hands out zero-copy buffers into its memory map (``begin(buffers=True)``),
so a disk hit whose pages are in the page cache costs what a memory-tier hit
does: a ``memcpy`` of its byte ranges into the batch, plus the entry's xxh3
checksum (disk bytes can rot, and LMDB does not checksum its pages; the check
is injected by the cache, :meth:`DiskGather.enable_gather`, so the store stays
bytes-only). The check reads the copies just made, while they are in the CPU
cache (``codec.checksum_matches_copied``): one pass over the entry in memory.
One read transaction per call, closed before the call returns: a read
transaction held across a training step would keep LMDB from reusing the pages
writers free (the file would grow).

:meth:`DiskGather.prefetch` reads the pages of entries about to be gathered
into the page cache (py-lmdb touches every page of a value it returns, with the
GIL released); the loader's read-ahead calls it from a few threads, in the
batches' order, so a cold page cache is read with several entries in flight.

Thread/process safety: as the rest of :class:`~mmcache.stores.disk.DiskStore`
(each call opens its own read transaction; the buffers never leave it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from mmcache.errors import CacheError
from mmcache.stores.base import KEY_SIZE, Keys
from mmcache.stores.disk.counters import Counter, CounterFile
from mmcache.stores.disk.env import EnvHandle, Txn
from mmcache.stores.disk.packs import read_packed
from mmcache.stores.gathercheck import (
    CopiedCheck,
    EntryCheck,
    RowsCheck,
    ranges_apart,
    tile_ranges,
)

__all__ = ["DiskGather", "EntryCheck"]

logger = logging.getLogger(__name__)


def key_list(keys: Keys) -> list[bytes]:
    """``keys`` (16-byte ``bytes`` each, or ``uint8 [n, 16]``) as a list of bytes."""
    if isinstance(keys, np.ndarray):
        if keys.dtype != np.uint8 or keys.ndim != 2 or keys.shape[1] != KEY_SIZE:
            raise ValueError(f"keys as an array must be uint8 [n, {KEY_SIZE}], got {keys.shape}")
        flat = np.ascontiguousarray(keys).tobytes()
        return [flat[i : i + KEY_SIZE] for i in range(0, len(flat), KEY_SIZE)]
    out = list(keys)
    for k in out:
        if not isinstance(k, bytes) or len(k) != KEY_SIZE:
            raise ValueError(f"store keys are {KEY_SIZE}-byte digests, got {k!r}")
    return out


def _check_targets(n: int, targets: Sequence[tuple[int, int, npt.NDArray[np.uint8]]]) -> int:
    end = 0
    for offset, length, out in targets:
        if offset < 0 or length < 0:
            raise ValueError(f"offset and length must be >= 0, got {offset}, {length}")
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != np.uint8
            or out.ndim != 2
            or out.shape[0] < n
            or out.shape[1] != length
            or not out.flags.writeable
        ):
            raise ValueError(f"out must be a writeable uint8 array of shape [>={n}, {length}]")
        end = max(end, offset + length)
    return end


class DiskGather:
    """The batch-reading half of :class:`~mmcache.stores.disk.DiskStore` (a mixin).

    Gathering is off until the owner installs the entry check
    (:meth:`enable_gather`): an unverified disk read is never served.
    """

    supports_gather: bool = False
    _gather_check: EntryCheck | None = None
    _gather_copied: CopiedCheck | None = None
    _gather_rows_check: RowsCheck | None = None
    _counters: CounterFile
    name: str

    # Provided by DiskStore (declared here for the type checker).
    def _env(self) -> EnvHandle:  # pragma: no cover - overridden
        raise NotImplementedError

    def _count_reads(
        self, keys: Sequence[bytes], found: Sequence[bool]
    ) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def discard(
        self, key: bytes, *, why: Literal["corrupt", "expired"]
    ) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def enable_gather(
        self,
        check: EntryCheck,
        *,
        copied: CopiedCheck | None = None,
        rows: RowsCheck | None = None,
    ) -> None:
        """Let the loader gather from this store; every entry gathered must pass ``check``.

        ``copied`` (``codec.checksum_matches_copied``): the same check, reading the
        byte ranges just copied into the batch instead of the map. A gather then
        copies an entry's ranges first and checks them while they are still in the
        CPU cache (one pass over the entry's bytes in memory, not two); a failed
        entry's rows are left for the caller to produce again, as any absent one.
        ``rows`` (``codec.checksums_match_rows``, with ``copied``): the check of many
        entries of one length from the batch's rows, for the entries the gathered
        ranges tile (see the module docstring).
        """
        self._gather_check = check
        self._gather_copied = copied
        self._gather_rows_check = rows if copied is not None else None
        self.supports_gather = True

    def gather_ranges(
        self,
        keys: Keys,
        targets: Sequence[tuple[int, int, npt.NDArray[np.uint8]]],
        *,
        count: bool = True,
    ) -> npt.NDArray[np.bool_]:
        """:meth:`~mmcache.stores.base.BatchReader.gather_ranges`: key ``i`` into row ``i``."""
        ks = key_list(keys)
        return self.gather_rows(ks, np.arange(len(ks), dtype=np.int64), targets, count=count)

    def gather_rows(
        self,
        keys: Keys,
        rows: npt.NDArray[np.int64],
        targets: Sequence[tuple[int, int, npt.NDArray[np.uint8]]],
        *,
        count: bool = True,
    ) -> npt.NDArray[np.bool_]:
        """Copy the ranges of key ``j`` into row ``rows[j]`` of each target; the found mask.

        Every key is read in one read transaction, closed before this returns. An
        entry that fails the check is not served: it is discarded (counted
        ``corrupt``, logged) and reads as absent, so the caller produces it again.
        """
        ks = key_list(keys)
        n = len(ks)
        found = np.zeros(n, dtype=bool)
        check = self._gather_check
        if n == 0 or check is None:
            return found
        if len(rows) != n:
            raise ValueError(f"{n} keys but {len(rows)} rows")
        end = _check_targets(int(np.max(rows)) + 1, targets)
        copied = self._gather_copied if ranges_apart(targets) else None
        rows_check = self._gather_rows_check if copied is not None else None
        tiled_ranges = tile_ranges(targets, end, int(np.max(rows)) + 1) if rows_check else None
        pieces, tiles = tiled_ranges or ([], [])
        order = sorted(targets, key=lambda t: t[0])
        row_list = rows.tolist()
        corrupt: list[bytes] = []
        try:
            h = self._env()
            with Txn(h, buffers=True) as txn:
                get, data = txn.get, h.data
                seen: dict[int, memoryview] = {}
                tiled: list[tuple[int, memoryview]] = []  # (j, buffer): checked as a batch
                for j, key in enumerate(ks):
                    buf = get(key, db=data)
                    if buf is None:  # packed, or absent
                        buf = read_packed(txn, h, key, seen)
                    if buf is None or len(buf) < end:
                        continue
                    if tiles and len(buf) == end:
                        tiled.append((j, buf))  # (each get returns a buffer of its own)
                        continue
                    src = np.frombuffer(buf, dtype=np.uint8)
                    r = row_list[j]
                    if copied is not None:  # copy, then check the copies (cache-hot)
                        copies = []
                        for offset, length, out in order:
                            dst = out[r]
                            dst[...] = src[offset : offset + length]
                            copies.append((offset, dst))
                        ok = copied(buf, copies)
                    else:
                        ok = check(buf)
                        if ok:
                            for offset, length, out in order:
                                out[r] = src[offset : offset + length]
                    if not ok:
                        corrupt.append(key)
                        continue
                    found[j] = True
                if tiled and rows_check is not None:
                    tiled_rows = [row_list[j] for j, _ in tiled]

                    def copy_entry(i: int) -> None:  # just before entry i is hashed
                        src, r = np.frombuffer(tiled[i][1], dtype=np.uint8), tiled_rows[i]
                        for start, stop, out in tiles:
                            out[r] = src[start:stop]

                    good = rows_check(end, pieces, tiled_rows, copy_entry).tolist()
                    for (j, _), ok in zip(tiled, good, strict=True):
                        if ok:
                            found[j] = True
                        else:
                            corrupt.append(ks[j])
                    tiled.clear()  # the buffers end with the transaction
        except CacheError as exc:
            logger.warning("disk-tier gather failed, its reads are misses: %s", exc)
            found[:] = False
        for key in corrupt:
            logger.error("corrupt disk-tier entry %s dropped (checksum mismatch)", key.hex())
            self.discard(key, why="corrupt")
        if count:
            self._count_reads(ks, found.tolist())
        return found

    def contains_many(self, keys: Keys) -> npt.NDArray[np.bool_]:
        """Presence of each key, in one read transaction (no hit/miss counted)."""
        ks = key_list(keys)
        out = np.zeros(len(ks), dtype=bool)
        if not ks:
            return out
        h = self._env()
        with Txn(h) as txn:
            meta = h.meta
            for j, key in enumerate(ks):
                out[j] = txn.get(key, db=meta) is not None
        return out

    def count_reads(self, *, hits: int = 0, misses: int = 0) -> None:
        """Add to the node-wide hit and miss counters (after ``count=False`` gathers)."""
        self._counters.add((Counter.HITS, hits), (Counter.MISSES, misses))

    def prefetch(self, keys: Keys) -> int:
        """Read the pages of ``keys``' entries into the page cache (and this process's
        page tables) ahead of their gather; returns the bytes of the entries found.

        py-lmdb reads one byte of every page of a value it returns, with the GIL
        released, so the read itself brings the entry in: a page not resident is
        read from the device here, on the calling thread, instead of in the gather.
        (``mincore``/``MADV_WILLNEED`` on the value's range cannot do better: its
        address is known only after that read.) The read-ahead calls this from a
        few threads at once (:class:`~mmcache.loader.readahead.ReadAhead`), so as
        many entries are read from the device in parallel; on warm pages it costs
        about a microsecond an entry.
        """
        ks = key_list(keys)
        touched = 0
        if not ks:
            return 0
        try:
            h = self._env()
            with Txn(h, buffers=True) as txn:
                get, data = txn.get, h.data
                seen: dict[int, memoryview] = {}
                for key in ks:
                    buf = get(key, db=data)
                    if buf is None:  # packed, or absent
                        buf = read_packed(txn, h, key, seen)
                    if buf is not None:
                        touched += len(buf)
        except CacheError as exc:  # a hint only: a failure costs page faults later
            logger.debug("disk-tier prefetch failed: %s", exc)
        return touched
