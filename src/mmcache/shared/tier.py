"""``SharedTier``: a tier below the node's disk tier, on a shared file system or an
object store, that every node, job and later run reads before it produces.

Entries are the codec's bytes (with its checksum) in immutable packs, each made
visible by committing its index whole (:mod:`mmcache.shared.layout`,
:mod:`mmcache.shared.writer`). A reader lists the committed indexes once when it first
needs them and again at most every ``refresh`` seconds when a key is not found
(a new process lists at open: DataLoader workers that are not persistent are new
processes each epoch), keeps them merged as columns (:mod:`mmcache.shared.index`), and
reads entries with ranged reads, a batch's misses grouped per pack
(:meth:`SharedTier.fetch_ahead`, which the loader calls with each batch's misses
before it looks them up one by one).

As a store. Its abilities are declared: it has no byte budget of its own (``bounded
= False``: what a share holds is its owner's business, ``mmcache gc --shared``), and it
is not gathered from in the training process. Writes are immutable and shared, so
``delete``, ``discard`` and ``expire`` hide entries from this handle only (the next
``get`` misses, the entry is produced again and published anew); nothing is removed
from the share but by its ``gc``. ``put`` appends to this process's open pack (read
back at once by this handle, by other processes once committed). Counters are this
handle's (one per process), not the node's.

Failures never stop training: a share that cannot be reached (listing, reading or
publishing fails after the retry policy, or the circuit breaker is open) is logged
once per process and the tier answers "absent" (entries are produced locally), trying
again at the next refresh. A damaged entry (the codec's checksum) is dropped by the
tier list's read check, as in every tier: logged, counted ``corrupt``, hidden here and
produced again. A damaged index is skipped whole, logged once.

Trust: entries written by other users' jobs are trusted as far as the share's own
permissions go (who may write the folder or bucket). The checksum proves an entry is
the one its writer wrote, not that its writer was honest.

Thread-safe (one lock around the merged index; the writer locks itself); fork-aware:
a forked child keeps the parent's merged index and starts its own writer and threads.
Pickles as its configuration.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from mmcache.checks import check_int
from mmcache.errors import ConfigError, CorruptEntryError, RemoteError
from mmcache.shared.access import Listed, Share, check_location, plan_spans
from mmcache.shared.index import MergedIndex, split_keys
from mmcache.shared.layout import MAX_ENTRY, MAX_INDEX_BYTES, IndexArrays, decode_index
from mmcache.shared.writer import PackWriter
from mmcache.sources.blobs.retry import RetryPolicy
from mmcache.stats import TierStats
from mmcache.stores.base import EntryInfo, Keys, Store, check_key
from mmcache.stores.tiered import Row
from mmcache.units import MiB, parse_size

__all__ = ["SharedTier"]

logger = logging.getLogger(__name__)

#: Entries fetched ahead and not yet taken, per process, at most this many bytes.
_FETCHED_BYTES = 256 * MiB


class SharedTier(Store):
    """A shared tier at ``url`` (a folder on a shared file system, or an object store's
    URL such as ``s3://bucket/prefix``, ``gs://bucket/prefix``). See the module docstring.

    Args:
        url: where the share lives; a folder is created when first published to.
        storage_options: the options of an object store (credentials, endpoint:
            :class:`~mmcache.sources.blobs.objects.Remote`).
        publish: whether entries this process produces are published (``False``: reads only).
        pack_bytes: a pack is committed once it holds this much (int or ``"64MiB"``).
        linger: seconds without a new entry after which an open pack is committed
            (persistent DataLoader workers publish between epochs so); 0: only when
            full, flushed or closed.
        refresh: at most this often (seconds) a key not found lists the share again.
        retries: the :class:`~mmcache.sources.blobs.retry.RetryPolicy` of every call
            (or the retries after the first try), with its circuit breaker.
        spool_dir: where open packs are spooled (default: the system's temporary folder).

    >>> import tempfile
    >>> share = SharedTier(tempfile.mkdtemp())
    >>> share.put(bytes(16), b"entry"), share.get(bytes(16))
    (True, b'entry')
    >>> share.close()  # commits the open pack: other processes and nodes see it now
    >>> SharedTier(share.url).get(bytes(16))
    b'entry'
    """

    name = "shared"
    bounded = False

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        publish: bool = True,
        pack_bytes: int | str = 64 * MiB,
        linger: float = 5.0,
        refresh: float = 30.0,
        retries: int | RetryPolicy = 3,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        location = check_location(url)
        if not isinstance(publish, bool):
            raise ConfigError(f"publish must be True or False, got {publish!r}")
        self.pack_bytes = parse_size(pack_bytes, name="pack_bytes")
        check_int("pack_bytes", self.pack_bytes, minimum=1)
        for label, value in (("linger", linger), ("refresh", refresh)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{label} must be seconds >= 0, got {value!r}")
        self.publish = publish
        self.linger = float(linger)
        self.refresh_every = float(refresh)
        self.spool_dir = None if spool_dir is None else os.fspath(spool_dir)
        self.storage_options = dict(storage_options or {})
        self.retries = retries
        self.share = Share(location, storage_options=self.storage_options, retries=retries)
        self.url = self.share.url
        self._setup()

    def _setup(self) -> None:
        """This process's state: the merged index, the writer, the counters."""
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._index = MergedIndex()
        self._listed_at: float | None = None
        self._failed: set[str] = set()  # indexes found damaged (skipped, logged once)
        self._fetched: OrderedDict[bytes, bytes] = OrderedDict()
        self._fetched_bytes = 0
        self._warned = False
        self._closed = False
        self._hits = self._misses = self._puts = self._admitted = self._refused = 0
        self._corrupt = self._expired = 0
        self._writer = self._new_writer()

    def _new_writer(self) -> PackWriter | None:
        if not self.publish:
            return None
        return PackWriter(
            self.share,
            pack_bytes=self.pack_bytes,
            linger=self.linger,
            spool_dir=self.spool_dir,
            committed=self._committed,
            failed=self._unreachable,
        )

    def _here(self) -> None:
        """A forked child starts its own writer (its parent's packs are its parent's)."""
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._lock = threading.RLock()
            if self._writer is not None:
                self._writer.abandon()
            self._writer = self._new_writer()

    def __repr__(self) -> str:
        return f"SharedTier({self.share.describe()!r}, publish={self.publish})"

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "storage_options": self.storage_options,
            "publish": self.publish,
            "pack_bytes": self.pack_bytes,
            "linger": self.linger,
            "refresh": self.refresh_every,
            "retries": self.retries,
            "spool_dir": self.spool_dir,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def handle(self) -> SharedTier:
        """A new handle on the same share with the same configuration (its own index,
        writer and counters): what a :class:`~mmcache.cache.Cache` opens."""
        return SharedTier(**self.__getstate__())

    # -- the merged index -------------------------------------------------------------------
    def refresh(self) -> int:
        """List the share's committed indexes and merge the new ones; drop packs gone.
        Returns the entries added. Never raises for a share that cannot be reached (one
        warning per process; the index stays as it was)."""
        self._here()
        self.share.remote.new_epoch()
        try:
            listed = self.share.list_indexes()
        except (RemoteError, OSError) as exc:
            self._unreachable("listing its indexes", exc)
            with self._lock:
                self._listed_at = time.monotonic()
            return 0
        with self._lock:
            loaded = self._index.loaded()
        names = {entry.pack for entry in listed}
        new = [e for e in listed if e.pack not in loaded and e.pack not in self._failed]
        packs = self._read_indexes(sorted(new, key=lambda e: e.pack))
        with self._lock:
            gone = sorted(loaded - names)
            self._index.drop_packs(gone)
            added = self._index.add(packs)
            self._listed_at = time.monotonic()
        return added

    def _read_indexes(self, listed: list[Listed]) -> list[tuple[str, IndexArrays]]:
        ok = [e for e in listed if e.size <= MAX_INDEX_BYTES]
        for e in listed:
            if e.size > MAX_INDEX_BYTES:
                self._damaged_index(e.pack, f"{e.size} bytes, over {MAX_INDEX_BYTES}")
        out = []
        for entry, data in zip(ok, self.share.read_indexes(ok), strict=True):
            if isinstance(data, RemoteError):
                if data.kind == "not-found":  # removed by gc since the listing
                    continue
                self._unreachable(f"reading the index of pack {entry.pack}", data)
                continue
            try:
                out.append((entry.pack, decode_index(data, name=entry.pack)))
            except CorruptEntryError as exc:
                self._damaged_index(entry.pack, str(exc))
        return out

    def _damaged_index(self, pack: str, why: str) -> None:
        self._failed.add(pack)
        logger.error(
            "shared tier %s: index of pack %s skipped (%s); its entries are produced again "
            "(mmcache gc --shared removes it once old)",
            self.share.describe(),
            pack,
            why,
        )

    def _unreachable(self, what: str, exc: BaseException) -> None:
        """One warning per process for everything the share could not do (listing,
        reading, publishing); later failures at debug level."""
        if not self._warned:
            self._warned = True
            logger.warning(
                "shared tier %s cannot be reached (%s: %s): entries are produced and kept "
                "locally; it is tried again at the next refresh, and this process logs no "
                "further warning for it",
                self.share.describe(),
                what,
                exc,
            )
        else:
            logger.debug("shared tier %s: %s: %s", self.share.url, what, exc)

    def _ensure(self, *, missed: bool = False) -> None:
        """List the share if never listed, or (after a key was not found) if the last
        listing is older than ``refresh``."""
        at = self._listed_at
        if at is None or (missed and time.monotonic() - at >= self.refresh_every):
            self.refresh()

    def _committed(self, pack: str, index: IndexArrays) -> None:
        """The writer published ``pack``: merge it now (no listing needed to see it)."""
        with self._lock:
            self._index.add([(pack, index)])

    def _rows(self, keys: Keys) -> np.ndarray:
        hi, lo = split_keys(keys)
        with self._lock:
            return self._index.find(hi, lo)

    # -- reads ------------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        """The entry of ``key`` (this process's own unpublished ones included), or None.
        One ranged read, or none when :meth:`fetch_ahead` brought it. Thread-safe."""
        check_key(key)
        self._here()
        with self._lock:
            raw = self._fetched.pop(key, None)
            if raw is not None:
                self._fetched_bytes -= len(raw)
        if raw is None and self._writer is not None:
            raw = self._writer.read(key)
        if raw is None:
            raw = self._read([key]).get(key)
        with self._lock:
            if raw is None:
                self._misses += 1
            else:
                self._hits += 1
        return raw

    def fetch_ahead(self, keys: Keys) -> None:
        """Read the entries of ``keys`` this tier holds, grouped by pack (one ranged read
        per run of neighbouring entries, on a few threads at once), and keep them for the
        next :meth:`get` of each (at most 256 MiB per process, the oldest dropped)."""
        self._here()
        found = self._read(keys)
        with self._lock:
            for key, raw in found.items():
                if key in self._fetched:
                    continue
                self._fetched[key] = raw
                self._fetched_bytes += len(raw)
            while self._fetched_bytes > _FETCHED_BYTES and self._fetched:
                _, old = self._fetched.popitem(last=False)
                self._fetched_bytes -= len(old)

    def _read(self, keys: Keys) -> dict[bytes, bytes]:
        """The entries of ``keys`` in the merged index, read grouped by pack."""
        self._ensure()
        rows = self._rows(keys)
        if (rows < 0).any():
            before = self._listed_at
            self._ensure(missed=True)
            if self._listed_at != before:
                rows = self._rows(keys)
        wanted = np.flatnonzero(rows >= 0)
        if not len(wanted):
            return {}
        key_list = (
            [bytes(k) for k in np.asarray(keys, np.uint8).reshape(-1, 16)]
            if isinstance(keys, np.ndarray)
            else list(keys)
        )
        with self._lock:
            r = self._index.rows
            by_pack: dict[str, list[tuple[int, int, int]]] = {}
            for i in wanted:
                row = int(rows[i])
                pack = self._index.packs[int(r.pack[row])]
                by_pack.setdefault(pack, []).append((int(i), int(r.offset[row]), int(r.size[row])))
        spans = [s for pack, entries in by_pack.items() for s in plan_spans(pack, entries)]
        out: dict[bytes, bytes] = {}
        for span, data in zip(spans, self.share.read_spans(spans), strict=True):
            if isinstance(data, RemoteError):
                self._lost(span.pack, data)
                continue
            view = memoryview(data)
            for tag, at, size in span.parts:
                out[key_list[tag]] = bytes(view[at : at + size])
        return out

    def _lost(self, pack: str, err: RemoteError) -> None:
        """A pack could not be read: gone (gc), or the share cannot be reached."""
        if err.kind == "not-found":
            with self._lock:
                self._index.drop_packs([pack])
            logger.info("shared tier %s: pack %s is gone (gc)", self.share.url, pack)
            return
        self._unreachable(f"reading pack {pack}", err)

    def contains(self, key: bytes) -> bool:
        check_key(key)
        return bool(self.contains_many([key])[0])

    def contains_many(self, keys: Keys) -> npt.NDArray[np.bool_]:
        self._here()
        self._ensure()
        found: np.ndarray = self._rows(keys) >= 0
        writer = self._writer
        if writer is not None and not found.all():
            seq = (
                [bytes(k) for k in np.asarray(keys, np.uint8).reshape(-1, 16)]
                if isinstance(keys, np.ndarray)
                else list(keys)
            )
            for i in np.flatnonzero(~found):
                found[i] = writer.holds(seq[i])
        return found

    def info(self, key: bytes) -> EntryInfo | None:
        check_key(key)
        self._here()
        if self._writer is not None:
            for pack in reversed(self._writer.pending()):
                got = pack.rows.get(key)
                if got is not None:
                    return EntryInfo(size=got[1], cost=got[2], ctime=got[3], atime=0.0, hits=0)
        self._ensure()
        row = int(self._rows([key])[0])
        if row < 0:
            return None
        with self._lock:
            r = self._index.rows
            return EntryInfo(
                size=int(r.size[row]),
                cost=float(r.cost[row]),
                ctime=float(r.ctime[row]),
                atime=0.0,
                hits=0,
            )

    def keys(self) -> Iterator[bytes]:
        self._here()
        self._ensure()
        with self._lock:
            listed = list(self._index.keys())
        seen = set(listed)
        yield from listed
        for key in self._pending_keys():
            if key not in seen:
                seen.add(key)
                yield key

    def _pending_keys(self) -> list[bytes]:
        if self._writer is None:
            return []
        out: list[bytes] = []
        for pack in self._writer.pending():
            out.extend(pack.rows)
        return out

    def _pending_sizes(self) -> dict[bytes, int]:
        """This process's unpublished entries and their sizes (the newest of each key)."""
        out: dict[bytes, int] = {}
        if self._writer is not None:
            for pack in self._writer.pending():
                out.update((k, row[1]) for k, row in pack.rows.items())
        return out

    def _counted(self) -> tuple[int, int]:
        """Entries and bytes held: the merged index's, this process's own replacing any
        listed copy of their keys (no walk of the index in Python)."""
        self._here()
        self._ensure()
        pending = self._pending_sizes()
        keys = list(pending)
        rows = self._rows(keys) if keys else np.zeros(0, np.int64)
        with self._lock:
            count, size = self._index.count(), self._index.nbytes()
            listed = rows[rows >= 0]
            count -= len(listed)
            size -= int(self._index.rows.size[listed].sum(dtype=np.uint64))
        return count + len(pending), size + sum(pending.values())

    def __len__(self) -> int:
        return self._counted()[0]

    def nbytes(self) -> int:
        return self._counted()[1]

    def capacity(self) -> int:
        """No budget of its own (``bounded = False``): the largest size there is."""
        return 2**63 - 1

    def stats(self) -> TierStats:
        """This handle's reads and puts; the entries and bytes of the merged index."""
        self._here()
        with self._lock:
            items, size = self._index.count(), self._index.nbytes()
            return TierStats(
                hits=self._hits,
                misses=self._misses,
                puts=self._puts,
                admitted=self._admitted,
                refused=self._refused,
                expired=self._expired,
                corrupt=self._corrupt,
                bytes=size,
                budget=None,
                items=items,
            )

    # -- writes -----------------------------------------------------------------------------
    def put(
        self, key: bytes, value: bytes | memoryview, *, cost: float = 0.0, ctime: float = 0.0
    ) -> bool:
        """Append ``value`` to this process's open pack (published when it is committed);
        False with ``publish=False`` or for an entry over 1 GiB."""
        check_key(key)
        raw = value if isinstance(value, bytes) else bytes(value)
        return self.put_many([(key, raw, cost, ctime)])[0]

    def put_many(self, rows: Sequence[Row]) -> list[bool]:
        """:meth:`put` of many rows at once (the write-behind's groups)."""
        self._here()
        ok = [self._writer is not None and len(r[1]) <= MAX_ENTRY for r in rows]
        taken = [r for r, good in zip(rows, ok, strict=True) if good]
        for key, *_ in taken:
            self._unhide(key)
        if taken and self._writer is not None:
            self._writer.append(taken)
        with self._lock:
            self._puts += len(rows)
            self._admitted += len(taken)
            self._refused += len(rows) - len(taken)
        return ok

    def _unhide(self, key: bytes) -> None:
        with self._lock:
            self._fetched.pop(key, None)

    def commit(self) -> None:
        """Publish what this process wrote (seal and commit its open pack)."""
        self._here()
        if self._writer is not None:
            self._writer.commit()

    def delete(self, key: bytes) -> bool:
        """Hide ``key`` from this handle (see the module docstring); whether it was there."""
        return self._hide(key, None)

    def discard(self, key: bytes, *, why: Any) -> bool:
        """Hide a damaged or expired entry from this handle, counted as ``why``."""
        return self._hide(key, why)

    def _hide(self, key: bytes, why: str | None) -> bool:
        check_key(key)
        self._here()
        present = False
        if self._writer is not None:
            present = self._writer.forget(key)
        row = int(self._rows([key])[0])
        with self._lock:
            self._fetched.pop(key, None)
            if row >= 0:
                self._index.hide(row)
                present = True
            if present and why == "corrupt":
                self._corrupt += 1
            elif present and why == "expired":
                self._expired += 1
        return present

    def expire(self, before: float) -> int:
        """Hide the entries created before ``before`` from this handle; how many."""
        self._here()
        self._ensure()
        old: list[bytes] = []
        # A key written again since its committed copy (a newer row in an open pack)
        # stays: only its older copy goes, and it is not counted as expired.
        fresh: set[bytes] = set()
        if self._writer is not None:
            for pack in self._writer.pending():
                for k, row in pack.rows.items():
                    if row[3] < before:
                        old.append(k)
                    else:
                        fresh.add(k)
        for key in old:
            self._hide(key, "expired")
        with self._lock:
            rows = self._index.rows
            stale = np.flatnonzero(~rows.hidden & (rows.ctime < before))
            stale_keys = {rows.key(int(r)) for r in stale}
            rows.hidden[stale] = True
            gone = (set(old) | stale_keys) - fresh
            self._expired += len(gone - set(old))
        return len(gone)

    def close(self) -> None:
        """Commit this process's open pack and release the threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid and self._writer is not None:
            self._writer.close()
        self.share.close()


#: ``Cache(shared=...)``: what it accepts.
SharedLike = str | os.PathLike[str] | SharedTier


def as_shared(shared: SharedLike | None) -> SharedTier | None:
    """``Cache(shared=...)``'s value as a :class:`SharedTier` (a path or URL opened with
    the defaults), None for None."""
    if shared is None or isinstance(shared, SharedTier):
        return shared
    return SharedTier(check_location(shared))
