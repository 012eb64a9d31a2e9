"""One process's attachment to a memory store: the node lock, the mappings, its process row.

Locking protocol (readers ``LOCK_SH``, writers ``LOCK_EX``; puts: see ``admission.py``):

* The exclusive holder writes its pid into the header and clears it on
  release; whoever next finds it set knows the previous holder died inside a
  critical section and rebuilds all derived state before going on. What that
  rebuild is, the session does not know: :meth:`Session.exclusive` and
  :meth:`Session.shared` call the ``repair`` callback the session was made with
  (``repair.repair_locked``), and so does an error inside a section.
* Reads run under ``LOCK_SH`` and update ``atime``/``hits`` in place (concurrent
  readers may lose an increment of an entry's ``hits``; it is a policy hint).
* Creating a store runs under the exclusive lock (``StoreState``), so whoever
  else takes the lock and finds it unfinished knows its creator died.
* The index grows under the exclusive lock (a new generation, ``index.py``); every
  section, shared or exclusive, first maps the generation the header names
  (:meth:`Session.adopt_index`), so a process never looks up in a replaced index.

Data-path waits are bounded (``DATA_LOCK_TIMEOUT``, see :meth:`Session.wait`): a
process stopped inside a section (SIGSTOP, Ctrl-Z) costs others one bounded wait and
one warning naming it, then reads are misses and puts refused until it lets go.

Processes are identified by ``(pid, start time)``, so every user of a store
must share one pid namespace; opening a store created in another one (another
container sharing ``/dev/shm``) raises ``CacheError``. Each attached process has a
row in the process table (``procs.py``). A session survives ``fork``: the child
becomes a separate user (its own row, locks and thread locks) on first use.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator

from mmcache.errors import CacheError
from mmcache.stores.base import is_no_space
from mmcache.stores.memory import shm
from mmcache.stores.memory.access import Access, UntrustedFileError
from mmcache.stores.memory.index import (
    Index,
    IndexLayout,
    grow_target,
    index_path,
    index_paths,
    index_problem,
    remove_stale,
)
from mmcache.stores.memory.layout import (
    FLAG_TEMPORARY,
    H_CAPACITY,
    H_ENTRIES,
    H_FLAGS,
    H_HOLDER_PID,
    H_INDEX_GEN,
    H_MAGIC,
    H_MAX_ENTRIES,
    H_META_SIZE,
    H_PID_NAMESPACE,
    H_STATE,
    H_TOMBSTONES,
    H_USED_CELLS,
    H_VERSION,
    MAGIC,
    MAX_PROCS,
    ROW_OVERFLOW,
    VERSION,
    Count,
    Layout,
    Meta,
    Owner,
    StoreState,
    data_paths,
    initialise_meta,
    lock_path,
    meta_path,
    read_header,
    remove_file,
)
from mmcache.stores.memory.procs import ProcessTable
from mmcache.stores.memory.shm import (
    EXCLUSIVE,
    SHARED,
    LockTimeout,
    NodeLock,
    Segment,
    pid_namespace,
)
from mmcache.stores.memory.slabs import Damaged, Slabs, data_problem, slot_sizes_upto
from mmcache.stores.memory.table import EntryTable

__all__ = ["DATA_LOCK_TIMEOUT", "OPEN_TIMEOUT", "Session"]

log = logging.getLogger(__name__)

#: How long opening a store waits for a live holder of the lock (seconds).
OPEN_TIMEOUT = 30.0
#: How long a read or a put waits for the lock (seconds) before it gives up: a miss or a
#: refused put, with one warning naming the holder. A live holder keeps the lock for
#: micro- to milliseconds; only a stopped (SIGSTOP, Ctrl-Z) or stuck one holds it longer.
#: After a wait ran out, data-path calls do not wait at all for as long again.
DATA_LOCK_TIMEOUT = 10.0

# Bumped in every fork child, so a session notices it crossed a fork.
_FORK_GENERATION = [0]


def _bump_fork_generation() -> None:
    _FORK_GENERATION[0] += 1


os.register_at_fork(after_in_child=_bump_fork_generation)

#: Rebuilds a store's derived state; called with the exclusive lock held (see module doc).
Repair = Callable[["Session", str], None]


class Session:
    """This process's attachment to the store ``name``: lock, mappings, process row.

    After :meth:`attach`: ``meta`` (the meta segment's views), ``table`` (the entry
    table and hash index of the index generation in use, ``index.py``), ``slabs`` (the
    size classes' mappings), ``procs`` (the attached processes and their counters,
    ``procs.py``; ``row`` is ours), and the store's ``capacity``, ``max_entries`` and
    ``temporary`` as it was created (which may differ from what was asked);
    ``entries`` is the index's size now. ``broken``: why a data segment could not be used,
    once one could not (reads miss, puts are refused; see ``slabs.py``).

    Holds no reference to the store it serves (``repair`` is a plain function), so a
    store dropped without ``close()`` is detached at once by :meth:`__del__`.
    Thread-safe and process-safe; fork-safe (see the module docstring).
    """

    directory: str
    lock: NodeLock
    meta: Meta
    table: EntryTable
    slabs: Slabs
    procs: ProcessTable
    capacity: int
    max_entries: int
    temporary: bool
    pid: int
    fork_gen: int

    def __init__(self, name: str, access: Access, repair: Repair) -> None:
        self.name = name
        self.access = access
        self._repair = repair
        self.closed = True
        self.row = -1
        self.stuck_until = 0.0  # see wait()
        self.broken: str | None = None
        self.warned: set[str] = set()
        self._count_lock = threading.Lock()
        self._index_lock = threading.Lock()  # one thread maps a new index generation

    @property
    def entries(self) -> int:
        """The entries the index holds now (it grows up to ``max_entries``)."""
        return self.table.entries

    # ------------------------------------------------------------------ attach

    def attach(
        self,
        *,
        capacity: int,
        entries: int,
        max_entries: int,
        create: bool,
        temporary: bool,
        owner: Owner | None,
    ) -> None:
        """Open (or create) the store and register this process. Process-safe.

        ``entries``: the size of a new store's first index; ``max_entries``: the most
        it may grow to. An existing store keeps its own (see ``_open_locked``).
        """
        self._first_entries = min(entries, max_entries)
        self.directory = self.access.ensure_directory(shm.SHM_DIR, create=create)
        for _ in range(10):
            path = lock_path(self.directory, self.name)
            lock = NodeLock(path, create=create, access=self.access)
            try:
                with lock.hold(EXCLUSIVE, timeout=OPEN_TIMEOUT):
                    if lock.unlinked():
                        continue  # removed while we waited: open the new one
                    self.lock = lock
                    self._open_locked(capacity, max_entries, create, temporary, owner)
                    self.pid = os.getpid()
                    self.fork_gen = _FORK_GENERATION[0]
                    self.closed = False
                    self._mark_holder()
                    try:
                        self._register_locked()
                        self.reclaim_locked()
                    except BaseException:
                        self._repair(self, "an error while attaching")
                        raise
                    finally:
                        self.meta.header[H_HOLDER_PID] = 0
                break
            except BaseException:
                if self.closed:
                    self.unmap()
                    lock.close()
                raise
            finally:
                if self.__dict__.get("lock") is not lock:  # set once attached (see unmap)
                    lock.close()
        else:  # pragma: no cover - needs ten unlinks racing one open
            raise CacheError(f"memory store {self.name!r} keeps being removed while opening")
        if self.temporary:
            atexit.register(_close_at_exit, weakref.ref(self))

    def _open_locked(
        self, capacity: int, entries: int, create: bool, temporary: bool, owner: Owner | None
    ) -> None:
        # ``entries``: the most entries asked for (``max_entries``).
        """Map the meta segment, creating or repairing it. Caller holds the lock exclusively."""
        meta = meta_path(self.directory, self.name)
        seg: Segment | None = None
        try:
            seg = Segment.open(meta, access=self.access)
        except FileNotFoundError:
            pass
        except CacheError as exc:
            if not create or isinstance(exc, UntrustedFileError):
                raise
            log.warning("memory store %s: meta segment truncated, re-creating it", self.name)
        if seg is not None:
            header = read_header(seg)
            problem = None
            if int(header[H_MAGIC]) != MAGIC or int(header[H_META_SIZE]) != seg.size:
                problem = "it is not an mmcache store of this version or is truncated"
            elif int(header[H_VERSION]) != VERSION:
                problem = f"it has format version {int(header[H_VERSION])}, not {VERSION}"
            elif int(header[H_STATE]) != StoreState.READY:
                problem = "its creator died while initialising it"
            elif int(header[H_PID_NAMESPACE]) != pid_namespace():
                del header
                seg.close()
                # Liveness checks by pid cannot work across pid namespaces: a live
                # writer of another container would look dead and lose its slot.
                raise CacheError(
                    f"memory store {self.name!r} belongs to processes of another pid"
                    " namespace (another container sharing /dev/shm); give each container"
                    " its own cache root or store name"
                )
            del header
            if problem is None:
                self._bind(seg)
                damaged = data_problem(
                    self.directory, self.name, self.access, self.capacity, self.meta.classes
                ) or index_problem(
                    self.directory, self.name, self.access, int(self.meta.header[H_INDEX_GEN])
                )
                same = self.capacity == capacity and self.max_entries == entries
                if damaged is not None and (self.procs.any_attached() or not create):
                    # Advice that works from here: gc skips a store in use.
                    root = self.meta.owner_path(errors="replace")
                    if self.procs.any_attached():
                        fix = "processes still attached to it; it is re-created once they exit"
                    elif root is not None:
                        fix = f"remove it with mmcache gc --cache {root}"
                    else:
                        fix = f"remove it with mmcache.stores.memory.reclaim_orphans({self.name!r})"
                    self.unmap()
                    raise CacheError(f"memory store {self.name!r} cannot be used: {damaged}; {fix}")
                if damaged is not None:
                    log.warning("memory store %s: re-creating it: %s", self.name, damaged)
                elif same or not create or self.procs.any_attached():
                    # create=False only attaches (mmcache verify/stats): never re-create.
                    if not same:
                        log.warning(
                            "memory store %s exists with capacity %d B and at most %d entries"
                            " (asked %d B, %d): using it as it is, other processes are"
                            " attached",
                            self.name, self.capacity, self.max_entries, capacity, entries,
                        )  # fmt: skip
                    self._map_index()
                    if int(self.meta.header[H_HOLDER_PID]) != 0:
                        self._repair_locked("a process died holding the lock")
                    else:
                        self._remove_stale_indexes()
                    return
                else:
                    log.info(
                        "memory store %s: re-creating it with capacity %d B, at most %d entries"
                        " (was %d B, %d); no other process is attached",
                        self.name, capacity, entries, self.capacity, self.max_entries,
                    )  # fmt: skip
                self.unmap()
            else:
                seg.close()
                if not create:
                    raise CacheError(
                        f"memory store {self.name!r} at {meta} cannot be used: {problem};"
                        " open it with create=True to re-create it"
                    )
                log.warning("memory store %s: re-creating it: %s", self.name, problem)
        elif not create:
            raise CacheError(
                f"no memory store named {self.name!r} ({meta} is missing): create it with"
                " create=True"
            )
        self._initialise_locked(capacity, entries, temporary, owner)

    def _initialise_locked(
        self, capacity: int, max_entries: int, temporary: bool, owner: Owner | None
    ) -> None:
        """Create a fresh, empty store. Caller holds the lock exclusively."""
        removed: list[str] = []
        d, name = self.directory, self.name
        for path in [*data_paths(d, name), *index_paths(d, name), meta_path(d, name)]:
            remove_file(path, removed)
        sizes = slot_sizes_upto(capacity)
        layout = Layout.build(classes=len(sizes), procs=MAX_PROCS)
        entries = self._first_entries
        self._warn_if_shm_small(capacity)
        index: Index | None = None
        try:
            seg = Segment.create(
                meta_path(d, name), layout.size, access=self.access, reserve=[(0, layout.size)]
            )
            try:
                index = Index.create(d, name, self.access, gen=0, entries=entries, rows=0)
            except BaseException:
                seg.close()
                remove_file(meta_path(d, name), removed)
                raise
        except OSError as exc:
            if not is_no_space(exc):
                raise
            # Nothing of the store is left but its lock file: remove it too (processes
            # waiting for it see it unlinked and start over), so a failed open leaves
            # nothing behind in /dev/shm.
            remove_file(lock_path(d, name), removed)
            # The index's hash table is reserved whole: with a large index_capacity it is
            # most of what the tables need.
            _, table_bytes = IndexLayout.build(entries).table_range()
            raise CacheError(
                f"no space left in {shm.SHM_DIR} for memory store {name!r}: its tables"
                f" need more than {layout.size + table_bytes} B ({exc.strerror}); free space there"
                " (mmcache gc removes stale stores; in Docker raise --shm-size) or pass"
                " memory=0"
            ) from exc
        index.close()
        initialise_meta(
            seg,
            layout,
            capacity=capacity,
            entries=entries,
            max_entries=max_entries,
            slot_sizes=sizes,
            temporary=temporary,
            owner=owner,
            created_at=time.time_ns(),
            pid_namespace=pid_namespace(),
        )
        self._bind(seg)
        self._map_index()
        self.meta.header[H_STATE] = StoreState.READY

    def _bind(self, seg: Segment) -> None:
        """Make this process's views of the meta segment (header already valid)."""
        try:
            meta = Meta(seg, self.name)
        except CacheError:
            seg.close()
            raise
        self.meta = meta
        h = meta.header
        self.capacity = int(h[H_CAPACITY])
        self.max_entries = int(h[H_MAX_ENTRIES])
        self.temporary = bool(int(h[H_FLAGS]) & FLAG_TEMPORARY)
        self.procs = ProcessTable(meta.procs, meta.counters)
        self.slabs = Slabs(
            meta.classes,
            self.capacity,
            directory=self.directory,
            name=self.name,
            access=self.access,
        )

    # ------------------------------------------------------------------ the index

    def _map_index(self) -> None:
        """Map the index generation the header names (the meta segment is bound)."""
        gen = int(self.meta.header[H_INDEX_GEN])
        self.table = EntryTable(
            self.meta, Index.open(self.directory, self.name, self.access, gen), self.name
        )

    def adopt_index(self) -> None:
        """Map the generation the header names if the index grew since. Caller holds the lock.

        The old generation's mapping is dropped by reference, not closed: no section of
        this process can be reading it (it grew under the exclusive lock, so every
        section that had looked it up ended before), and a stale reference would still
        read valid (old) bytes, never freed memory. Thread-safe.
        """
        with self._index_lock:
            if int(self.meta.header[H_INDEX_GEN]) == self.table.gen:
                return
            try:
                self._map_index()
            except CacheError as exc:  # removed by hand, truncated: the tier failed here
                raise Damaged(str(exc)) from exc

    def grow_index_locked(self) -> bool:
        """Replace a full index by a larger generation (see ``index.py``); whether it grew.

        False when it is at ``max_entries`` or ``/dev/shm`` has no room for the new
        generation (then it stays as it is). Caller holds EX; its ``table`` references
        are stale afterwards (use ``self.table``).
        """
        t = self.table
        target = grow_target(
            entries=t.entries,
            max_entries=self.max_entries,
            items=t.items() + t.writing(),
            nbytes=t.nbytes(),
            capacity=self.capacity,
        )
        if target <= t.entries or t.gen >= 999:
            return False
        gen = t.gen + 1
        try:
            index = Index.create(
                self.directory, self.name, self.access, gen=gen, entries=target,
                rows=t.rows_reserved(),
            )  # fmt: skip
        except OSError as exc:
            if not is_no_space(exc):
                raise
            if self.warn_once("grow-enospc"):
                log.warning(
                    "memory store %s: its index is full (%d entries) and %s has no room for a"
                    " larger one (%d entries); evicting instead",
                    self.name, t.entries, shm.SHM_DIR, target,
                )  # fmt: skip
            return False
        used = t.copy_to(index)
        h = self.meta.header
        h[H_INDEX_GEN] = gen  # the commit point: from here on the new generation is the store's
        h[H_ENTRIES] = target
        h[H_USED_CELLS] = used
        h[H_TOMBSTONES] = 0
        self.table = EntryTable(self.meta, index, self.name)
        remove_file(index_path(self.directory, self.name, t.gen), [])
        log.info(
            "memory store %s: index grown from %d to %d entries (%d held, %d of %d B)",
            self.name, t.entries, target, t.items(), t.nbytes(), self.capacity,
        )  # fmt: skip
        return True

    def _remove_stale_indexes(self) -> None:
        """Unlink index files of other generations (a grow that died). Caller holds EX."""
        removed: list[str] = []
        remove_stale(self.directory, self.name, self.table.gen, removed)
        if removed:
            log.info("memory store %s: removed stale index files %s", self.name, removed)

    def _repair_locked(self, reason: str) -> None:
        """The repair callback, after removing what a grow that died left. Caller holds EX."""
        self._remove_stale_indexes()
        self._repair(self, reason)

    def unmap(self) -> None:
        """Drop every mapping of this process (views first, so the mmaps can close).

        The mappings are attributes while attached and absent before and after (an
        attach may fail half way): each is taken out of the instance's dict, if there."""
        mapped = self.__dict__
        slabs = mapped.pop("slabs", None)
        if slabs is not None:
            slabs.close()
        table = mapped.pop("table", None)
        if table is not None:
            table.release()
            index = table.index
            del table
            index.close()
        mapped.pop("procs", None)
        meta = mapped.pop("meta", None)
        if meta is not None:
            meta.close()

    def _warn_if_shm_small(self, capacity: int) -> None:
        try:
            st = os.statvfs(shm.SHM_DIR)
        except OSError:
            return
        free = st.f_bavail * st.f_frsize
        if free < capacity:
            log.warning(
                "memory store %s: capacity %d B but only %d B free in %s; puts will be refused"
                " when it fills (in Docker, raise --shm-size)",
                self.name, capacity, free, shm.SHM_DIR,
            )  # fmt: skip

    # ------------------------------------------------------------------ the process table

    def _register_locked(self) -> None:
        """Add this process to the attached table (pruning dead ones). Caller holds EX."""
        self.row = self.procs.register()
        if self.row == ROW_OVERFLOW and self.warn_once("procs"):
            log.warning(
                "memory store %s: more than %d attached processes; statistics of the"
                " extra ones share one row and may lose increments",
                self.name, MAX_PROCS,
            )  # fmt: skip

    def ensure_process(self) -> None:
        """Raise if closed; after a fork, become a separate user of the store."""
        if self.closed:
            raise CacheError(f"memory store {self.name!r} is closed")
        if self.fork_gen != _FORK_GENERATION[0]:
            self.pid = os.getpid()
            self.fork_gen = _FORK_GENERATION[0]
            self.row = -1  # the parent's row is not ours
            self._count_lock = threading.Lock()
            self.slabs.after_fork()
            with self.exclusive():
                self._register_locked()

    def count(self, column: Count, n: int = 1) -> None:
        """Add ``n`` to this process's counter ``column``."""
        with self._count_lock:
            self.procs.add(self.row, column, n)

    def warn_once(self, tag: str) -> bool:
        """True the first time ``tag`` is asked for (per store object): warn then."""
        if tag in self.warned:
            return False
        self.warned.add(tag)
        return True

    def reclaim_locked(self) -> int:
        """Free WRITING entries whose writer died; count and log them. Caller holds EX."""
        reclaimed = self.table.reclaim_dead_writers(self.slabs)
        if reclaimed:
            self.count(Count.RECLAIMED, reclaimed)
            log.info(
                "memory store %s: reclaimed %d entries left half-written by dead processes",
                self.name, reclaimed,
            )  # fmt: skip
        return reclaimed

    # ------------------------------------------------------------------ detach

    def close(self) -> None:
        """Detach this process and unmap. Idempotent (see ``MemoryStore.close``)."""
        if self.closed:
            return
        try:
            attached = self.fork_gen == _FORK_GENERATION[0] and os.getpid() == self.pid
            if attached and not self.lock.closed:
                with contextlib.suppress(CacheError), self.exclusive(timeout=OPEN_TIMEOUT):
                    self._detach_locked()
        finally:
            self.closed = True
            self.unmap()
            self.lock.close()

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # Dropped without close(): detach now, so the attached-process table (and the
        # lifetime of a temporary store) follows the objects really in use. Never
        # wait for the lock here: the garbage collector may run this in a thread
        # that holds it through another object (a view() block).
        # The lock may be finalized already (both were garbage in one cycle: its
        # descriptors are closed): then the row stays until this process exits, when
        # the next opener prunes it. Never raises: nobody could catch it.
        # ``sys.is_finalizing`` is bound as a default: at interpreter exit this runs
        # after the module's globals were cleared (``sys`` is None by then), and a
        # store left open by a plain script is common ("Exception ignored in
        # Session.__del__" was printed at every such exit).
        if self.__dict__.get("closed", True) or _finalizing():  # (an __init__ that failed)
            return
        self.closed = True
        try:
            attached = self.fork_gen == _FORK_GENERATION[0] and os.getpid() == self.pid
            if attached and not self.lock.closed and self.lock.try_exclusive():
                try:
                    h = self.meta.header
                    if int(h[H_STATE]) == StoreState.READY and int(h[H_HOLDER_PID]) == 0:
                        self._detach_locked()
                finally:
                    self.lock.release()
        except (OSError, ValueError, AttributeError) as exc:  # CacheError is an OSError
            log.debug("memory store %s: detach at garbage collection: %s", self.name, exc)
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                self.unmap()
            with contextlib.suppress(OSError, ValueError, AttributeError):
                self.lock.close()

    def _detach_locked(self) -> None:
        """Leave the attached table; the last user of a temporary store removes it. EX held."""
        if 0 <= self.row < MAX_PROCS:
            self.procs.retire(self.row)
        self.row = -1
        if self.temporary and not self.procs.any_attached():
            self.unlink_locked()

    def unlink(self) -> list[str]:
        """Remove the store's files now (for every process) and close; the paths removed."""
        removed: list[str] = []
        if not self.closed:
            with contextlib.suppress(CacheError), self.exclusive(timeout=OPEN_TIMEOUT):
                removed = self.unlink_locked()
            self.close()
        return removed

    def unlink_locked(self) -> list[str]:
        """Mark UNLINKED and remove every file, the lock file last. Caller holds EX."""
        self.meta.header[H_STATE] = StoreState.UNLINKED
        removed: list[str] = []
        d, name = self.directory, self.name
        for path in [
            *data_paths(d, name),
            *index_paths(d, name),
            meta_path(d, name),
            lock_path(d, name),
        ]:
            remove_file(path, removed)
        return removed

    # ------------------------------------------------------------------ locking

    @contextlib.contextmanager
    def exclusive(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the node lock exclusively; repair first if the last holder died in it.

        If the body raises, derived state is rebuilt before the lock is released,
        so an interrupted critical section never leaves inconsistent counts behind.
        """
        self.ensure_process()
        with self.lock.hold(EXCLUSIVE, timeout=timeout):
            h = self.meta.header
            if int(h[H_STATE]) != StoreState.READY:
                raise CacheError(
                    f"memory store {self.name!r} was removed by another process; reopen it"
                )
            if int(h[H_INDEX_GEN]) != self.table.gen:
                self.adopt_index()
            if int(h[H_HOLDER_PID]) != 0:
                self._repair_locked("a process died holding the lock")
            self._mark_holder()
            try:
                yield
            except BaseException:
                try:
                    self._repair_locked("an error inside a critical section")
                except BaseException:
                    log.exception("memory store %s: repair failed", self.name)
                    raise  # the holder pid stays set: the next holder repairs
                h[H_HOLDER_PID] = 0
                raise
            h[H_HOLDER_PID] = 0

    def _mark_holder(self) -> None:
        self.meta.header[H_HOLDER_PID] = os.getpid()

    @contextlib.contextmanager
    def shared(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the node lock shared (readers), after any repair a dead writer left due."""
        self.ensure_process()
        for _ in range(3):
            with self.lock.hold(SHARED, timeout=timeout):
                h = self.meta.header
                if int(h[H_STATE]) != StoreState.READY:
                    raise CacheError(
                        f"memory store {self.name!r} was removed by another process; reopen it"
                    )
                if int(h[H_HOLDER_PID]) == 0:
                    if int(h[H_INDEX_GEN]) != self.table.gen:
                        self.adopt_index()
                    yield
                    return
            with self.exclusive(timeout):
                pass  # repairs
        raise CacheError(f"memory store {self.name!r}: shared state cannot be repaired")

    def wait(self) -> float:
        """How long a data-path call waits for the lock (see ``DATA_LOCK_TIMEOUT``).

        Raises :class:`~mmcache.stores.memory.slabs.Damaged` once the tier failed here.
        """
        if self.broken is not None:
            raise Damaged(self.broken)
        return 0.0 if time.monotonic() < self.stuck_until else DATA_LOCK_TIMEOUT

    def fail(self, why: str) -> None:
        """Record that a data segment cannot be used here (the first reason is kept)."""
        if self.broken is None:
            self.broken = why

    def data_path_failed(self, exc: CacheError, outcome: str) -> None:
        """A read or put gave up (lock held too long, or a damaged segment): warn once."""
        if isinstance(exc, LockTimeout):
            self.stuck_until = time.monotonic() + DATA_LOCK_TIMEOUT
            holder = int(self.meta.header[H_HOLDER_PID]) if not self.closed else 0
            who = f"exclusive holder pid {holder}" if holder else "held shared"
            what = f"lock ({who}): {exc}"
            tag = "lock"
        else:
            self.fail(str(exc))
            what, tag = f"damaged: {exc}", "damaged"
        if self.warn_once(tag):
            log.warning(
                "memory store %s: %s; %s (the memory tier is bypassed, training goes on)",
                self.name, what, outcome,
            )  # fmt: skip


def _close_at_exit(ref: weakref.ref[Session]) -> None:
    session = ref()
    if session is not None:
        try:
            session.close()
        except Exception:  # at exit, report and go on: other stores still need closing
            log.exception("closing memory store %s at exit failed", session.name)
