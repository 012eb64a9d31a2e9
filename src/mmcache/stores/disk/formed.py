"""``FormedDiskStore``: a disk tier that stores each value in a compact form.

A :class:`~mmcache.stores.disk.DiskStore` whose values pass through a *form*
(an object with ``pack(value) -> bytes`` and ``unpack(stored) -> bytes``, e.g.
:class:`mmcache.codec.compact.DiskForm`) on the way in and out: ``put`` stores
``pack(value)``, ``get``/``view``/``get_many`` return ``unpack(stored)``. The
budget counts the stored (compact) bytes, so the same budget holds more entries.
A stored value that does not unpack (raises) is damaged: it is discarded
(counted ``corrupt``) and reads as absent.

Batch gathers in the training process (:meth:`FormedDiskStore.gather_rows`, on
once the cache installs the stored entries' check with ``enable_gather``, and
only for a form with ``write_ranges``): the stored entries are checked (their
own xxh3) and copied out under one short read transaction, then decoded
straight into the batch rows (``form.write_ranges``) on a small thread pool
(:data:`DECODE_THREADS`, the calling thread one of them; the decoders release
the GIL). An entry that fails its check or does not decode is discarded,
counted corrupt, and reads as absent: the caller produces it again.

Thread/process safety: as :class:`~mmcache.stores.disk.DiskStore`; the form
must be pure (it is pickled with the store for spawned workers); the decode
pool is per process (made again after a fork).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from mmcache.errors import CacheError
from mmcache.stores.base import Keys
from mmcache.stores.disk import DiskStore
from mmcache.stores.disk.env import Txn
from mmcache.stores.disk.gather import _check_targets, key_list
from mmcache.stores.disk.packs import read_packed

__all__ = ["DECODE_THREADS", "FormedDiskStore", "ValueForm", "WritesRanges"]

logger = logging.getLogger(__name__)

#: Threads decoding one gather's entries (the calling thread is one of them).
DECODE_THREADS = max(1, min(4, os.cpu_count() or 1))
_Targets = Sequence[tuple[int, int, npt.NDArray[np.uint8]]]
_pools: dict[int, ThreadPoolExecutor] = {}  # by pid: threads do not survive a fork
_pools_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _pools_lock  # noqa: PLW0603 - a lock held by a thread of the parent at the fork
    _pools_lock = threading.Lock()
    _pools.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _decode_pool() -> ThreadPoolExecutor:
    """This process's decode pool (the calling thread is the last decoder)."""
    with _pools_lock:
        pool = _pools.get(os.getpid())
        if pool is None:
            pool = ThreadPoolExecutor(DECODE_THREADS - 1 or 1, thread_name_prefix="mmcache-decode")
            _pools.clear()  # a forked parent's pool (its threads are not ours)
            _pools[os.getpid()] = pool
        return pool


class ValueForm(Protocol):
    """What a :class:`FormedDiskStore` needs of a form."""

    def pack(self, raw: bytes | memoryview) -> bytes: ...

    def unpack(self, stored: bytes | memoryview, *, limit: int | None = None) -> bytes: ...


@runtime_checkable
class WritesRanges(Protocol):
    """A form that writes byte ranges of an entry without building it (a batch gather
    straight from the stored form: :meth:`mmcache.codec.compact.DiskForm.write_ranges`).
    A :class:`FormedDiskStore` gathers batches only over such a form."""

    def write_ranges(
        self, stored: bytes, targets: Sequence[tuple[int, int, np.ndarray]], row: int
    ) -> bool: ...


class FormedDiskStore(DiskStore):
    """A :class:`DiskStore` whose values are stored as ``form.pack(value)``.

    Args: those of :class:`DiskStore`, and ``form``.
    """

    def __init__(self, path: Any, *, form: ValueForm, **kwargs: Any) -> None:
        self._form = form
        super().__init__(path, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "form": self._form}

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        form = state.pop("form")
        self.__init__(state.pop("path"), form=form, **state)  # type: ignore[misc]

    @property
    def form(self) -> ValueForm:
        """The form of the stored values."""
        return self._form

    def _unpack(self, key: bytes, stored: bytes | None) -> bytes | None:
        if stored is None:
            return None
        try:
            return self._form.unpack(stored, limit=self._capacity)
        except Exception as exc:  # damaged bytes: whatever the decoder raises
            logger.error("corrupt disk-tier entry %s dropped: %s", key.hex(), exc)
            self.discard(key, why="corrupt")
            return None

    def get(self, key: bytes) -> bytes | None:
        """The unpacked value, or None (absent or damaged). Counts a hit or a miss."""
        return self._unpack(key, super().get(key))

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self._unpack(k, v) for k, v in zip(keys, super().get_many(keys), strict=True)]

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        """A buffer of the unpacked value (a copy: the stored bytes are another form)."""
        value = self.get(key)
        yield None if value is None else memoryview(value)

    def put_many(
        self, entries: Iterable[tuple[bytes, bytes | memoryview, float, float]]
    ) -> list[bool]:
        """``put`` each ``(key, value, cost, ctime)`` as ``form.pack(value)``."""
        return super().put_many((k, self._form.pack(v), c, t) for k, v, c, t in entries)

    def verify(self, check: Callable[[bytes], bool]) -> list[bytes]:
        """Keys whose stored value does not unpack, or whose unpacked value fails ``check``."""

        def unpacked_ok(stored: bytes) -> bool:
            try:
                return check(self._form.unpack(stored, limit=self._capacity))
            except Exception:
                return False

        return super().verify(unpacked_ok)

    def enable_gather(
        self, check: Callable[[memoryview], bool], *, copied: Any = None, rows: Any = None
    ) -> None:
        """Gather batches here, checking each stored entry with ``check`` before its
        decode; stays off for a form without ``write_ranges`` (``copied`` and ``rows``
        are unused: the decode reads the stored bytes once, after the check)."""
        if isinstance(self._form, WritesRanges):
            super().enable_gather(check)

    def gather_rows(
        self,
        keys: Keys,
        rows: npt.NDArray[np.int64],
        targets: _Targets,
        *,
        count: bool = True,
    ) -> npt.NDArray[np.bool_]:
        """Write the raw-entry ranges of key ``j`` into row ``rows[j]`` of each target,
        decoding the stored form (``form.write_ranges``); the found mask.

        The stored entries are checked and copied out under one read transaction,
        closed before any decode; the decodes run on :data:`DECODE_THREADS` threads.
        An entry that fails its check or does not decode is discarded (counted
        ``corrupt``, logged) and reads as absent, so the caller produces it again.
        """
        ks = key_list(keys)
        n = len(ks)
        found = np.zeros(n, dtype=bool)
        check = self._gather_check
        form = self._form
        if n == 0 or check is None or not isinstance(form, WritesRanges):
            return found
        write = form.write_ranges
        if len(rows) != n:
            raise ValueError(f"{n} keys but {len(rows)} rows")
        _check_targets(int(np.max(rows)) + 1, targets)
        row_list = rows.tolist()
        stored: list[tuple[int, bytes]] = []
        corrupt: list[bytes] = []
        try:
            h = self._env()
            with Txn(h, buffers=True) as txn:
                get, data = txn.get, h.data
                seen: dict[int, memoryview] = {}
                for j, key in enumerate(ks):
                    buf = get(key, db=data)
                    if buf is None:  # packed, or absent
                        buf = read_packed(txn, h, key, seen)
                    if buf is None:
                        continue
                    if check(buf):
                        stored.append((j, bytes(buf)))
                    else:
                        corrupt.append(key)
        except CacheError as exc:
            logger.warning("disk-tier gather failed, its reads are misses: %s", exc)
            stored = []

        def decode(items: list[tuple[int, bytes]]) -> list[tuple[int, bool | None]]:
            out: list[tuple[int, bool | None]] = []
            for j, data in items:
                try:
                    out.append((j, bool(write(data, targets, row_list[j]))))
                except Exception as exc:  # a damaged entry: whatever the decoder raised
                    logger.error("disk-tier entry %s does not decode: %s", ks[j].hex(), exc)
                    out.append((j, None))
            return out

        parts = max(1, min(DECODE_THREADS, len(stored) // 4))
        chunks = [stored[i::parts] for i in range(parts)]
        futures = [_decode_pool().submit(decode, c) for c in chunks[1:]]
        done = decode(chunks[0])
        for fut in futures:
            done.extend(fut.result())
        for j, ok in done:
            if ok is None:
                corrupt.append(ks[j])
            elif ok:
                found[j] = True
        for key in corrupt:
            logger.error("corrupt disk-tier entry %s dropped", key.hex())
            self.discard(key, why="corrupt")
        if count:
            self._count_reads(ks, found.tolist())
        return found
