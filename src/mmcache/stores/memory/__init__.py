"""The node-shared memory tier: one copy of the cache per node, in ``/dev/shm``.

Every process of the node that opens a :class:`MemoryStore` with the same
``name`` (fork or spawn DataLoader workers, the ranks of ``torchrun``,
unrelated processes) sees the same entries, and reads them at memory speed:
:meth:`MemoryStore.gather` copies a whole batch of samples into a
preallocated array with one ``memcpy`` per sample, :meth:`MemoryStore.view`
lends a zero-copy buffer.

Budget: :meth:`~MemoryStore.nbytes` counts the payload of held entries (published
ones and reservations being written) and ``nbytes() <= capacity()`` holds at every
moment in every process (the RAM used beyond the payloads: ``layout.py``).

Clock: ``atime`` must be comparable between processes; the default
:func:`time.monotonic` is ``CLOCK_MONOTONIC``, one clock for the whole machine
on Linux. An injected clock must be shared the same way.

The package, split by the data each module owns:

* ``layout.py``: the files, the header words, the arrays of the meta segment, states;
* ``table.py``: the entry rows and the hash index over their keys;
* ``slabs.py``: the size classes, their data segments, slots, pages and the copies out;
* ``repair.py``: crash repair and ``check()``, pure functions over the table and slabs;
* ``session.py``: one process's attachment: the lock, the mappings, its process row;
* ``procs.py``: the attached processes and their statistics counters;
* ``admission.py``: the write path (the policy's victims, reserve, copy, publish);
* ``cleanup.py``: node-wide removal of stores nobody uses (``reclaim_orphans``);
* ``shm.py`` and ``access.py``: files in ``/dev/shm``, the node lock, who may use them;
* here: :class:`MemoryStore`, the public face, which only orchestrates them.

Measured, not kept: LMDB rooted in ``/dev/shm`` as this tier's engine (the disk tier's
code with ``sync=False``, the same budgets and policies; ``benchmarks/memory_engine.py``,
issue 38). Its warm loader epoch was 0.89x of this tier's with no workers and 0.88x with
two (per-round spreads 0.78-1.01), its engine alone 1.18x; the bar for replacing the hash
table, slabs and repair here was 0.85x. At the line, it was not swapped: the disk path makes
three LMDB lookups per sample where this tier makes one vectorised lookup per batch, and
what decides a swap was not measured (one LMDB writer per node on the cold path, eviction
below the data's size, many ranks at once, and what is built on this store: claims, the
cluster's in-flight tier, group sharing, orphan cleanup). Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from mmcache.checks import check_int
from mmcache.errors import ConfigError
from mmcache.policies import Policy, get_policy
from mmcache.stats import TierStats
from mmcache.stores.base import KEY_SIZE, EntryInfo, Keys, Store, check_key
from mmcache.stores.claims import Claims
from mmcache.stores.gathercheck import CopiedCheck, EntryCheck, GatherCheck, RowsCheck
from mmcache.stores.memory import repair
from mmcache.stores.memory.access import Access
from mmcache.stores.memory.admission import INLINE_COPY_MAX, Writer
from mmcache.stores.memory.cleanup import reclaim_orphans, unlink_store
from mmcache.stores.memory.index import index_paths
from mmcache.stores.memory.layout import (
    DEFAULT_INDEX_DIVISOR,
    MAX_INDEX_CAPACITY,
    MAX_INDEX_DIVISOR,
    MIN_INDEX_CAPACITY,
    OWNER_PATH_MAX,
    Count,
    EntryState,
    Owner,
    StoreState,
    data_paths,
    default_index_capacity,
    default_max_entries,
    lock_path,
    meta_path,
    store_dir,
    store_exists,
)
from mmcache.stores.memory.session import Session
from mmcache.stores.memory.shm import LockTimeout, check_store_name
from mmcache.stores.memory.slabs import Damaged, check_targets
from mmcache.stores.memory.table import keys_array

__all__ = [
    "DEFAULT_INDEX_DIVISOR",
    "INLINE_COPY_MAX",
    "MAX_INDEX_CAPACITY",
    "MAX_INDEX_DIVISOR",
    "MIN_INDEX_CAPACITY",
    "EntryState",
    "MemoryStore",
    "StoreState",
    "default_index_capacity",
    "default_max_entries",
    "reclaim_orphans",
    "store_dir",
    "store_exists",
    "unlink_store",
]

log = logging.getLogger(__name__)


class MemoryStore(Store):
    """Node-shared byte store in ``/dev/shm``; see the package docstring for the design.

    Args:
        name: identifies the store on the node (files ``mmcache-<name>*`` in
            :func:`store_dir`: ``/dev/shm/mmcache-u<uid>/``, or ``mmcache-g<gid>/``
            with ``group``); every process opening the same name there shares the
            same entries.
        capacity: hard byte budget of the payloads held.
        policy: admission/eviction policy (name or instance), consulted when full.
            It is per-process configuration; give every process the same one.
        create: create the store if it does not exist (else ``CacheError``).
        temporary: remove the files when the last attached process closes.
        owner_path: the cache root this store belongs to; :func:`reclaim_orphans`
            removes unused stores whose owner path no longer exists.
        owner_id: the identity of that root (its ``root-id``, see
            :func:`mmcache.cacheroot.root_id`; 0: none): an unused store whose owner
            path now holds a root of another identity (removed and made again) is
            removed too.
        clock: source of ``atime`` (must be comparable across processes).
        index_capacity: the entries the index holds, fixed (a warning says when it
            is full while bytes are free). Default: it starts at capacity / 4 KiB
            entries (in [1024, 2**31 - 1]) and grows, sized from the entry sizes seen,
            whenever it is full while bytes of the budget are free, up to capacity /
            64 B entries (the smallest slot; in [1024, 2**31 - 1]).
        mode: file mode of the segments (default ``0o600``: this user only).
        group: share the store with the members of this group (a gid; needs
            ``mode=0o660``): its files go to ``/dev/shm/mmcache-g<gid>/``.

    Files another user could have planted are never used: see ``access.py``
    (``CacheError`` naming the file and its owner).

    If the store exists, its configuration (capacity, index capacity,
    temporary, owner path) wins unless no other live process is attached and
    ``capacity``/``index_capacity`` differ: then it is re-created empty.

    Every method is thread-safe and process-safe. Objects survive ``fork``
    (the child re-registers itself) and pickle by configuration (a spawned
    worker re-attaches by name).

    >>> import uuid
    >>> with MemoryStore(f"doc-{uuid.uuid4().hex}", capacity=1 << 20, temporary=True) as s:
    ...     s.put(b"k" * 16, b"hello")
    ...     s.get(b"k" * 16)
    True
    b'hello'
    """

    name = "memory"
    supports_gather = True
    _gather_check: GatherCheck | None = None

    def __init__(
        self,
        name: str,
        *,
        capacity: int,
        policy: str | Policy = "value",
        create: bool = True,
        temporary: bool = False,
        owner_path: str | None = None,
        owner_id: int = 0,
        clock: Callable[[], float] = time.monotonic,
        index_capacity: int | None = None,
        mode: int = 0o600,
        group: int | None = None,
    ) -> None:
        self.shm_name = check_store_name(name)
        check_int("memory store capacity (bytes)", capacity, minimum=1)
        if index_capacity is not None:
            check_int("index_capacity", index_capacity, minimum=1, maximum=MAX_INDEX_CAPACITY)
        access = Access(mode, group)  # validates both
        owner = None if owner_path is None else os.path.abspath(os.fspath(owner_path))
        if owner is not None and len(owner.encode()) > OWNER_PATH_MAX:
            raise ConfigError(f"owner_path is longer than {OWNER_PATH_MAX} bytes: {owner[:80]}...")
        check_int("owner_id", owner_id, minimum=0, maximum=(1 << 63) - 1)
        self._policy = get_policy(policy)
        self._config: dict[str, Any] = {
            "name": name,
            "capacity": capacity,
            "policy": self._policy,
            "create": bool(create),
            "temporary": bool(temporary),
            "owner_path": owner,
            "owner_id": owner_id,
            "clock": clock,
            "index_capacity": index_capacity,
            "mode": mode,
            "group": group,
        }
        self._clock = clock
        self._session = Session(self.shm_name, access, repair.repair_locked)
        self._writer = Writer(self._session, self._policy, clock)
        self._session.attach(
            capacity=capacity,
            entries=index_capacity or default_index_capacity(capacity),
            max_entries=index_capacity or default_max_entries(capacity),
            create=bool(create),
            temporary=bool(temporary),
            owner=None if owner is None else Owner(owner, owner_id),
        )

    # ------------------------------------------------------------------ lifetime

    def __getstate__(self) -> dict[str, Any]:
        """Configuration only: mappings, descriptors and locks never cross processes."""
        state = dict(self._config)
        state["gather_check"] = self._gather_check
        if not self._session.closed:
            # Re-attach with the store's actual sizes, so the child never re-creates it.
            state["capacity"] = self._session.capacity
            state["index_capacity"] = self._session.max_entries
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        check = state.pop("gather_check", None)
        self.__init__(**state)  # type: ignore[misc]
        self._gather_check = check

    def __repr__(self) -> str:
        s = self._session
        status = "closed" if s.closed else f"{self.nbytes()}/{s.capacity} B"
        return f"MemoryStore({self.shm_name!r}, {status}, policy={self._policy!r})"

    def close(self) -> None:
        """Detach this process and unmap. Idempotent.

        With ``temporary=True`` the last attached process to close removes the
        files. Thread-safe; call it once no thread uses the store any more. A store
        dropped without ``close()`` is detached when it is garbage-collected.
        """
        self._session.close()

    def unlink(self) -> list[str]:
        """Remove the store's files now (for every process) and close; return the paths removed.

        Processes still attached keep their mappings until they close, but
        every further operation of theirs raises ``CacheError``. Process-safe.
        """
        return self._session.unlink()

    # ------------------------------------------------------------------ reads

    def get(self, key: bytes) -> bytes | None:
        """Return a copy of the value, or None. Counts a hit or a miss. Thread/process-safe."""
        check_key(key)
        s = self._session
        e = -1
        try:
            with s.shared(s.wait()):
                t = s.table
                e = t.find_ready(key)
                if e >= 0:
                    value = t.payload(e, s.slabs).tobytes()
                    t.touch(e, self._clock())
        except (LockTimeout, Damaged) as exc:
            s.data_path_failed(exc, "reads are misses")
            e = -1
        if e < 0:
            s.count(Count.MISSES)
            return None
        s.count(Count.HITS)
        return value

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        """Lend a zero-copy, read-only buffer of the value (None if absent).

        The shared lock is held for the whole ``with`` block, so writers of the
        whole node wait: keep it short, and do not write to the store inside
        it (``RuntimeError``). The buffer is released at the end of the block
        (unless something still exports it, e.g. ``np.frombuffer``; then it
        must not be used after the block). Counts a hit or a miss.
        Thread/process-safe.
        """
        check_key(key)
        s = self._session
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(s.shared(s.wait()))
                t = s.table
                e = t.find_ready(key)
                row = t.payload(e, s.slabs) if e >= 0 else None
            except (LockTimeout, Damaged) as exc:
                s.data_path_failed(exc, "reads are misses")
                stack.close()
                e, row = -1, None
            if e < 0 or row is None:
                s.count(Count.MISSES)
                yield None
                return
            t.touch(e, self._clock())
            s.count(Count.HITS)
            base = row.data
            mv = base.toreadonly()
            try:
                yield mv
            finally:
                with contextlib.suppress(BufferError):
                    mv.release()
                    base.release()

    def enable_gather(
        self,
        check: EntryCheck,
        *,
        copied: CopiedCheck | None = None,
        rows: RowsCheck | None = None,
    ) -> None:
        """Check every entry a gather copies with ``check`` (``codec.checksum_matches``)
        before it is served; ``copied`` (``codec.checksum_matches_copied``) is the same
        check reading the copies just made, and ``rows`` (``codec.checksums_match_rows``)
        the same for a batch of entries of one size at once
        (:mod:`mmcache.stores.gathercheck`).

        The owner installs it (the cache does, for its memory tier and the cluster's
        in-flight tier): bytes in ``/dev/shm`` can be changed by any process of the
        user after they were checked on the way in, so a gather never trusts them. An
        entry that fails is discarded (counted ``corrupt``, logged) and reads as
        absent: the caller produces it again. Without a check every entry is served
        as found (a store used for bytes that are not codec entries).
        """
        self._gather_check = GatherCheck(check, copied, rows)

    def gather(
        self, keys: Keys, offset: int, length: int, out: npt.NDArray[np.uint8]
    ) -> npt.NDArray[np.bool_]:
        """Copy bytes ``[offset, offset+length)`` of each present entry into ``out[i]``.

        ``out`` is a preallocated ``uint8`` array of shape ``[len(keys), length]``
        (rows of absent keys are left untouched). Returns the found mask. An
        entry shorter than ``offset + length`` counts as absent. One shared
        lock for the whole batch; the index lookup is vectorised over the
        batch; counts hits and misses and updates ``atime``/``hits``.
        Thread/process-safe.
        """
        return self.gather_ranges(keys, [(offset, length, out)])

    def gather_ranges(
        self,
        keys: Keys,
        targets: Sequence[tuple[int, int, npt.NDArray[np.uint8]]],
        *,
        count: bool = True,
    ) -> npt.NDArray[np.bool_]:
        """:meth:`gather` of several byte ranges at once: ``(offset, length, out)`` each.

        Every range of every key is copied under one shared lock, so no entry
        can be replaced between two of its ranges (a batch never mixes two
        versions of a sample). A key is found when it is present and holds
        every range; only found rows are written, but for those of entries that fail
        the read check (:meth:`enable_gather`: copied, then checked; not found, so the
        caller fills them). ``count=False`` leaves the hit
        and miss counters alone (a caller that may not serve what it read counts
        with :meth:`count_reads`). Thread/process-safe.
        """
        n = len(keys)
        end = check_targets(n, targets)
        found = np.zeros(n, dtype=bool)
        if n == 0:
            return found
        q = keys_array(keys)
        s = self._session
        check = self._gather_check
        corrupt: list[bytes] = []
        try:
            with s.shared(s.wait()):
                t = s.table
                eids = t.lookup_ready(q)
                idx = np.flatnonzero(eids >= 0)
                e = eids[idx]
                fits = t.size[e] >= end
                idx, e = idx[fits], e[fits]
                if idx.shape[0] and check is not None:  # each entry copied, then checked
                    bad = s.slabs.copy_checked(
                        check, idx, t.cls[e], t.slot[e], t.size[e], targets=targets
                    )
                    if bad.any():
                        corrupt = [q[i].tobytes() for i in idx[bad].tolist()]
                        idx, e = idx[~bad], e[~bad]
                elif idx.shape[0]:
                    cls, slots = t.cls[e], t.slot[e]
                    for offset, length, out in targets:
                        if length:
                            s.slabs.copy_rows(
                                out, idx, cls, slots, start=offset, stop=offset + length
                            )
                if idx.shape[0]:
                    t.touch_many(e, self._clock())  # a key twice in a batch: two hits
                found[idx] = True
        except (LockTimeout, Damaged) as exc:
            s.data_path_failed(exc, "reads are misses")
            found[:] = False  # rows already copied are not served
            idx = np.zeros(0, np.int64)
        for k in dict.fromkeys(corrupt):  # outside the shared lock: a delete takes it whole
            log.error("corrupt entry %s of %s dropped (checksum mismatch)", k.hex(), self.shm_name)
            self.discard(k, why="corrupt")
        if count:
            hits = int(idx.shape[0])
            self.count_reads(hits=hits, misses=n - hits)
        return found

    def count_reads(self, *, hits: int = 0, misses: int = 0) -> None:
        """Add to this process's hit and miss counters (see ``gather_ranges(count=False)``)."""
        if hits:
            self._session.count(Count.HITS, hits)
        if misses:
            self._session.count(Count.MISSES, misses)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Copies of the values of ``keys`` (None where absent), under one shared lock.

        Counts hits and misses. Thread/process-safe.
        """
        n = len(keys)
        if n == 0:
            return []
        q = keys_array(keys)
        result: list[bytes | None] = [None] * n
        s = self._session
        try:
            with s.shared(s.wait()):
                t = s.table
                eids = t.lookup_ready(q)
                idx = np.flatnonzero(eids >= 0)
                e = eids[idx]
                for i, c, slot, size in zip(
                    idx.tolist(), t.cls[e].tolist(), t.slot[e].tolist(), t.size[e].tolist(),
                    strict=True,
                ):  # fmt: skip
                    result[i] = s.slabs.get(c).rows[slot, :size].tobytes()
                if idx.shape[0]:
                    t.touch_many(e, self._clock())
        except (LockTimeout, Damaged) as exc:
            s.data_path_failed(exc, "reads are misses")
            result = [None] * n
            idx = np.zeros(0, np.int64)
        self.count_reads(hits=int(idx.shape[0]), misses=n - int(idx.shape[0]))
        return result

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is present (no hit/miss counted). Thread/process-safe."""
        check_key(key)
        s = self._session
        try:
            with s.shared(s.wait()):
                return s.table.find_ready(key) >= 0
        except (LockTimeout, Damaged) as exc:
            s.data_path_failed(exc, "reads are misses")
            return False

    def contains_many(self, keys: Keys) -> npt.NDArray[np.bool_]:
        """Presence of each key (no hit/miss counted), under one shared lock, vectorised.

        ``keys``: a sequence of 16-byte keys, or a ``uint8 [n, 16]`` array of them.

        The loader asks this for every batch it plans (in its workers). Thread/process-safe.
        """
        if len(keys) == 0:
            return np.zeros(0, dtype=bool)
        one = _one_key(keys)  # a worker asks for one key per miss: no array round trip
        q = keys_array(keys) if one is None else np.zeros((0, 2), dtype=np.uint64)
        s = self._session
        try:
            with s.shared(s.wait()):
                if one is not None:
                    return np.array([s.table.find_ready(one) >= 0])
                found: npt.NDArray[np.bool_] = s.table.lookup_ready(q) >= 0
        except (LockTimeout, Damaged) as exc:
            s.data_path_failed(exc, "reads are misses")
            found = np.zeros(len(keys), dtype=bool)
        return found

    def info(self, key: bytes) -> EntryInfo | None:
        """Metadata of ``key`` or None (no hit/miss counted). Thread/process-safe."""
        check_key(key)
        with self._session.shared():
            t = self._session.table
            e = t.find_ready(key)
            return t.info(e) if e >= 0 else None

    def keys(self) -> Iterator[bytes]:
        """A snapshot of the keys present. Thread/process-safe."""
        with self._session.shared():
            t = self._session.table
            raw = t.key[t.ready_rows()].tobytes()
        return iter([raw[i : i + KEY_SIZE] for i in range(0, len(raw), KEY_SIZE)])

    def __len__(self) -> int:
        self._session.ensure_process()
        return self._session.table.items()

    def nbytes(self) -> int:
        """Payload bytes held now, reservations being written included. Process-safe."""
        self._session.ensure_process()
        return self._session.table.nbytes()

    def capacity(self) -> int:
        """The hard byte budget (the store's, which may differ from the one asked for)."""
        return self._session.capacity

    @property
    def policy(self) -> Policy:
        """The policy this process consults when the store is full."""
        return self._policy

    @property
    def index_capacity(self) -> int:
        """The most entries the store can hold (its index grows up to this, if it grows)."""
        return self._session.max_entries

    @property
    def index_entries(self) -> int:
        """The entries the index holds now (it grows when full while bytes are free)."""
        self._session.ensure_process()
        return self._session.entries

    @property
    def temporary(self) -> bool:
        """Whether the files go when the last attached process closes."""
        return self._session.temporary

    @property
    def claims_path(self) -> str:
        """The file whose byte ranges hold the node's production claims
        (:class:`mmcache.stores.claims.Claims`): the store's lock file, which lives as long
        as the store, with its owner and mode. Record locks on it are independent of the
        ``flock`` the store takes on it."""
        return self._session.lock.path

    def claims(self) -> Claims:
        """The node's production claims, on :attr:`claims_path` (see :meth:`Store.claims`)."""
        return Claims(self.claims_path)

    @property
    def owner_path(self) -> str | None:
        """The cache root recorded at creation, if any."""
        self._session.ensure_process()
        return self._session.meta.owner_path()

    @property
    def owner_id(self) -> int:
        """The identity of that root recorded at creation (0: none)."""
        self._session.ensure_process()
        return self._session.meta.owner_id()

    def stats(self) -> TierStats:
        """Counters summed over every process of the node that used the store. Process-safe."""
        s = self._session
        s.ensure_process()
        c = s.procs.totals()
        return TierStats(
            hits=int(c[Count.HITS]),
            misses=int(c[Count.MISSES]),
            puts=int(c[Count.PUTS]),
            admitted=int(c[Count.ADMITTED]),
            refused=int(c[Count.REFUSED]),
            evictions=int(c[Count.EVICTIONS]),
            expired=int(c[Count.EXPIRED]),
            corrupt=int(c[Count.CORRUPT]),
            bytes=s.table.nbytes(),
            budget=s.capacity,
            items=s.table.items(),
        )

    def segment_paths(self) -> list[str]:
        """The files of this store in ``/dev/shm`` (lock, meta, data), existing now."""
        d = self._session.directory
        paths = [lock_path(d, self.shm_name), meta_path(d, self.shm_name)]
        files = [p for p in paths if os.path.exists(p)]
        return files + index_paths(d, self.shm_name) + data_paths(d, self.shm_name)

    def resident_bytes(self) -> int:
        """RAM the store's files really hold now (tmpfs blocks), metadata included."""
        total = 0
        for path in self.segment_paths():
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(path).st_blocks * 512
        return total

    # ------------------------------------------------------------------ writes

    def put(
        self, key: bytes, value: bytes | memoryview, *, cost: float = 0.0, ctime: float = 0.0
    ) -> bool:
        """Store ``value`` under ``key`` if it fits or the policy makes room; return whether.

        Replacing a key is allowed; if the new value is refused, the old one is
        removed too (a new value for a key means the old one is stale). Returns
        False without storing when another live process is writing the same key
        at this moment, or when ``/dev/shm`` is full. An entry larger than the
        capacity is refused and logged once. Thread/process-safe; the payload
        is copied once (see ``admission.py``).
        """
        check_key(key)
        return self._writer.put(key, value, cost=cost, ctime=ctime)

    def discard(self, key: bytes, *, why: Literal["corrupt", "expired"]) -> bool:
        """Delete ``key`` and count it as ``corrupt`` or ``expired``. Thread/process-safe."""
        removed = self.delete(key)
        if removed:
            self._session.count(Count.CORRUPT if why == "corrupt" else Count.EXPIRED)
        return removed

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; return whether it was present. Thread/process-safe.

        An entry still being written by a live process is not present yet.
        """
        check_key(key)
        s = self._session
        with s.exclusive():
            e = s.table.find_ready(key)
            if e < 0:
                return False
            s.table.remove([e], s.slabs)
            return True

    def expire(self, before: float) -> int:
        """Remove entries whose ``ctime < before``; return how many. Thread/process-safe."""
        s = self._session
        with s.exclusive():
            rows = s.table.ready_rows()
            rows = rows[s.table.ctime[rows] < before]
            s.table.remove(rows.tolist(), s.slabs)
        if rows.shape[0]:
            s.count(Count.EXPIRED, int(rows.shape[0]))
        return int(rows.shape[0])

    def clear(self) -> int:
        """Remove every published entry; return how many. Thread/process-safe."""
        s = self._session
        with s.exclusive():
            rows = s.table.ready_rows()
            s.table.remove(rows.tolist(), s.slabs)
        return int(rows.shape[0])

    # ------------------------------------------------------------------ maintenance

    def verify(self, check: Callable[[bytes], bool]) -> list[bytes]:
        """Keys whose value fails ``check`` (the Cache passes the codec's checksum).

        Reads check the entries they serve (with the check the owner installs,
        :meth:`enable_gather`); this finds every byte changed in ``/dev/shm``, read or
        not. Each entry is copied under its own short shared section (writers wait
        for one copy, not the whole pass) and no hit, miss or access time is
        recorded. Bad entries are counted as ``corrupt`` but not deleted: the caller
        decides. Thread/process-safe.
        """
        s = self._session
        bad: list[bytes] = []
        for key in list(self.keys()):
            with s.shared():
                t = s.table
                e = t.find_ready(key)
                if e < 0:
                    continue
                value = t.payload(e, s.slabs).tobytes()
            if not check(value):
                bad.append(key)
        if bad:
            s.count(Count.CORRUPT, len(bad))
        return bad

    def check(self) -> list[str]:
        """Verify the shared invariants; return the problems found (empty: consistent).

        Checks the byte and item counts against the entry table, the budget,
        that every entry is reachable through the hash table, and that the slot
        bitmaps match the entries (``repair.check``). For tests, ``mmcache verify``
        and debugging. Thread/process-safe (shared lock).
        """
        s = self._session
        with s.shared():
            return repair.check(s.table, s.slabs, capacity=s.capacity)

    def gc(self) -> int:
        """Reclaim what dead processes left: half-written entries, attached-process rows;
        compact the hash table. Returns the entries reclaimed. Thread/process-safe."""
        s = self._session
        with s.exclusive():
            reclaimed = s.reclaim_locked()
            s.procs.prune()
            if s.table.tombstones():
                s.table.rehash()
        return reclaimed


def _one_key(keys: Keys) -> bytes | None:
    """The key when ``keys`` is a list or tuple of one valid key, else None: one probe of
    the table answers it (~1 us) where the vectorised lookup's numpy steps cost ~20 us."""
    if isinstance(keys, (list, tuple)) and len(keys) == 1:
        key = keys[0]
        if isinstance(key, bytes) and len(key) == KEY_SIZE:
            return key
    return None
