"""The operating-system pieces of the memory tier: files in ``/dev/shm``, a crash-proof
node-wide lock, and process liveness.

Why plain files in ``/dev/shm`` and not :class:`multiprocessing.shared_memory.SharedMemory`:
before Python 3.13 every process that attaches a ``SharedMemory`` registers it
with the ``resource_tracker``, which *unlinks* the segment when that process
exits, so the first spawn worker to exit destroys the node's cache for
everyone (CPython gh-82300). ``os.open`` + ``mmap`` has no tracker, lets us
choose the file mode (``0600``: other users of the node must not read the
training data), and gives a file descriptor for ``pwrite`` and
``flock``.

Why ``flock`` and not a lock living inside the shared memory (a futex, a
``multiprocessing.Lock``): the kernel releases an ``flock`` when its holder
dies, however it dies, so a ``kill -9`` can never leave the node locked
(mosaicml/streaming issues 717 and 781 are the failure we avoid: a lock and
segments left behind by a crashed run block the next one).

Nothing here knows the cache's data layout (that is ``layout.py``).

``SHM_DIR`` is read at call time (``shm.SHM_DIR``) by every module of the package, so a
test can point the whole tier at another folder by patching this one name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from mmcache.errors import CacheError, ConfigError
from mmcache.stores.memory.access import Access

__all__ = [
    "EXCLUSIVE",
    "PAGE_SIZE",
    "SHARED",
    "SHM_DIR",
    "SHM_PREFIX",
    "LockTimeout",
    "NodeLock",
    "Placed",
    "Segment",
    "check_store_name",
    "lock_holders",
    "map_arrays",
    "own_start_time",
    "page_round",
    "pid_alive",
    "pid_namespace",
    "place_arrays",
    "proc_start_time",
]

#: Where node-shared segments live: a tmpfs whose pages are RAM.
SHM_DIR = "/dev/shm"
#: Every file the memory tier creates starts with this (``reclaim_orphans`` scans it).
SHM_PREFIX = "mmcache-"
PAGE_SIZE = mmap.PAGESIZE


def page_round(n: int) -> int:
    """``n`` rounded up to whole pages."""
    return -(-n // PAGE_SIZE) * PAGE_SIZE


#: Where one array of a segment lives: ``(name, offset, dtype, shape)``.
Placed = tuple[str, int, str, tuple[int, ...]]


def place_arrays(
    spec: Sequence[tuple[str, str, tuple[int, ...]]],
) -> tuple[tuple[Placed, ...], int]:
    """Lay ``(name, dtype, shape)`` arrays out one after the other, each on a 64-byte
    boundary (a cache line); the placed arrays and the segment's size in whole pages."""
    fields = []
    offset = 0
    for name, dtype, shape in spec:
        offset = -(-offset // 64) * 64
        fields.append((name, offset, dtype, shape))
        offset += int(np.dtype(dtype).itemsize * np.prod(shape))
    return tuple(fields), page_round(offset)


def map_arrays(buf: Any, fields: Sequence[Placed]) -> dict[str, np.ndarray[Any, Any]]:
    """Numpy views of the placed arrays in ``buf`` (no copy)."""
    out = {}
    for name, offset, dtype, shape in fields:
        count = int(np.prod(shape))
        out[name] = np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(shape)
    return out


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_store_name(name: str) -> str:
    """Validate a store name: 1-128 characters of ``[A-Za-z0-9._-]``, starting with a letter/digit.

    The name becomes part of file names in a world-writable directory, so no
    separators or other surprises are allowed.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(
            f"memory store name must be 1-128 characters of [A-Za-z0-9._-] starting with a"
            f" letter or digit, got {name!r}"
        )
    return name


# --------------------------------------------------------------------------- liveness


def proc_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks since boot), or None if it is gone.

    Zombies (killed but not yet reaped) count as gone: they can never write again.
    ``(pid, start time)`` identifies a process even after its pid is reused.
    """
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X", b"x"):
        return None
    return int(fields[19])


def pid_alive(pid: int, start: int) -> bool:
    """Whether the process recorded as ``(pid, start)`` is still running.

    Assumes every process using a store shares one pid namespace (true for the
    ranks and DataLoader workers of one job or container).
    """
    now = proc_start_time(pid)
    return now is not None and now == start


_OWN_START: list[int] = [-1, 0]  # (pid, start time) of this process, cached


def own_start_time() -> int:
    """:func:`proc_start_time` of this process (cached per pid, so a fork child asks again)."""
    pid = os.getpid()
    if _OWN_START[0] != pid:
        _OWN_START[0] = pid
        _OWN_START[1] = proc_start_time(pid) or 0
    return _OWN_START[1]


def pid_namespace() -> int:
    """Identity of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


# --------------------------------------------------------------------------- segments


class Segment:
    """A file in ``/dev/shm`` mapped shared into this process.

    tmpfs allocates pages only when they are touched, so a segment can be sized
    virtually (to a whole budget) and costs only what is written. The catch:
    the first touch of a page *through the mapping*, a read as much as a write
    (a shared tmpfs mapping has no zero page to lend), allocates it, and when
    the tmpfs is full that allocation fails with SIGBUS, which kills the
    process. So every byte accessed through :attr:`buf` must lie in a range
    reserved first with :meth:`reserve` (``posix_fallocate``: a clean
    ``ENOSPC`` instead), or have been written with :meth:`write` (``pwrite``,
    same). Reserved pages stay allocated until punched (:meth:`punch`).

    Not thread-safe to close while in use; reads and writes through :attr:`buf`
    are coordinated by the caller's lock.
    """

    def __init__(self, path: str, fd: int, size: int) -> None:
        self.path = path
        self.fd = fd
        self.size = size
        self.buf: mmap.mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        # A segment dropped without close() must not leak its descriptor.
        self._close_fd = weakref.finalize(self, os.close, fd)

    @classmethod
    def create(
        cls, path: str, size: int, *, access: Access, reserve: Iterable[tuple[int, int]] = ()
    ) -> Segment:
        """Create a new zero-filled segment (fails if ``path`` exists), owned per ``access``.

        ``reserve``: ``(offset, length)`` ranges to allocate now (see
        :meth:`reserve`). If the file system has no room for them, the file is
        removed and the ``OSError`` (``ENOSPC``, see
        :func:`~mmcache.stores.base.is_no_space`) raised.
        """
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            access.created(fd)
            os.ftruncate(fd, size)
            seg = cls(path, fd, size)
            try:
                for offset, length in reserve:
                    seg.reserve(offset, length)
            except BaseException:
                seg.buf.close()
                seg._close_fd.detach()  # the handler below closes fd
                raise
            return seg
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise

    @classmethod
    def open(cls, path: str, size: int | None = None, *, access: Access) -> Segment:
        """Map an existing segment (its whole length when ``size`` is None).

        Raises ``CacheError`` if the file is not one ``access`` trusts (another
        user's: see :mod:`.access`) or is shorter than ``size``.
        """
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            access.check_fd(fd, path)
            actual = os.fstat(fd).st_size
            if size is None:
                size = actual
            if actual < size or size <= 0:
                raise CacheError(
                    f"shared-memory segment {path} has {actual} bytes, expected {size}:"
                    " it was truncated by another program; remove the store"
                    " (mmcache gc) and retry"
                )
            return cls(path, fd, size)
        except BaseException:
            os.close(fd)
            raise

    def reserve(self, offset: int, length: int) -> None:
        """Allocate the pages of ``[offset, offset+length)`` (whole pages, inside the file).

        ``posix_fallocate`` never changes the bytes (pages already there stay as
        they are, holes read as zeros), so it is safe on ranges other processes
        are using, and costs one syscall when the pages already exist. Raises
        ``OSError`` (``ENOSPC``/``EDQUOT``) when the file system has no room;
        tmpfs then gives back what the call had allocated.
        """
        start = offset // PAGE_SIZE * PAGE_SIZE
        stop = min(-(-(offset + length) // PAGE_SIZE) * PAGE_SIZE, self.size)
        if stop > start:
            os.posix_fallocate(self.fd, start, stop - start)

    def write(self, offset: int, data: memoryview) -> None:
        """Write ``data`` at ``offset`` with ``pwrite`` (one copy, straight into the page cache).

        Why not a copy through the mapping: ``pwrite`` takes no page fault per
        4 KiB (twice the put rate, measured), and when ``/dev/shm`` is full it
        raises ``OSError(ENOSPC)``, where a store through the mapping would
        kill the process with SIGBUS (Docker's default ``--shm-size`` is 64 MiB).
        """
        done = 0
        total = data.nbytes
        while done < total:
            done += os.pwrite(self.fd, data[done:], offset + done)

    def punch(self, offset: int, length: int) -> None:
        """Give the whole pages inside ``[offset, offset+length)`` back to the kernel.

        The range reads as zeros afterwards, in every process. Partial pages at
        the ends are kept (they may hold a neighbour's bytes).
        """
        start = -(-offset // PAGE_SIZE) * PAGE_SIZE
        stop = (offset + length) // PAGE_SIZE * PAGE_SIZE
        if stop > start:
            self.buf.madvise(mmap.MADV_REMOVE, start, stop - start)

    def close(self) -> None:
        """Unmap and close. Idempotent.

        If a caller still holds a buffer into the mapping (an unreleased
        ``view``), the unmap is left to the garbage collector instead of failing.
        """
        if self.fd < 0:
            return
        with contextlib.suppress(BufferError):
            self.buf.close()
        self._close_fd()
        self.fd = -1


# --------------------------------------------------------------------------- the node lock


class LockTimeout(CacheError):
    """A bounded wait for a :class:`NodeLock` ran out: a live process holds it (stopped?)."""


#: Waits at least this long poll every 50 ms; shorter ones (data-path reads and puts),
#: every 5 ms at most, so a lock freed a moment later costs little.
OPEN_WAIT_POLL = 20.0


def lock_holders(inode: int) -> list[int]:
    """Pids holding (or waiting for) an ``flock`` on the file with inode ``inode``.

    From ``/proc/locks`` (``N: FLOCK ADVISORY WRITE <pid> <maj>:<min>:<inode> ...``);
    empty where it cannot be read. Pids of other pid namespaces show as 0 there.
    """
    pids: list[int] = []
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                if "->" in fields:  # a waiter, listed under the holder
                    continue
                if len(fields) >= 6 and fields[1] == "FLOCK":
                    dev_inode = fields[5].rsplit(":", 1)
                    if len(dev_inode) == 2 and dev_inode[1] == str(inode):
                        with contextlib.suppress(ValueError):
                            pids.append(int(fields[4]))
    except OSError:
        return []
    return sorted(set(pids))


SHARED = fcntl.LOCK_SH
EXCLUSIVE = fcntl.LOCK_EX


def _close_all(fds: list[int], holders: list[_Holder]) -> None:
    """Close a lock's descriptors (``close()``, or the lock was garbage-collected)."""
    for h in holders:
        if h.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(h.fd)
            h.fd = -1
    holders.clear()
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


class _Holder:
    """One open file description of the lock file, owned by one thread of one process."""

    __slots__ = ("depth", "fd", "mode", "pid")

    def __init__(self, fd: int, pid: int) -> None:
        self.fd = fd
        self.pid = pid
        self.mode = 0
        self.depth = 0


class NodeLock:
    """A node-wide readers-writer lock on a file, released by the kernel if its holder dies.

    ``flock`` locks belong to an *open file description*: two threads using one
    descriptor, or a fork child using its parent's, would share (and silently
    convert) each other's locks. So every (process, thread) gets its own open
    file description, opened through ``/proc/self/fd/<anchor>``: that reaches
    the same inode even after the path was unlinked or re-created, so all users
    of one store always lock the same file.

    Re-entrant per thread: a shared or exclusive section may nest a shared one;
    asking for exclusive inside a shared section raises ``RuntimeError`` (flock
    would convert the lock non-atomically and drop the outer one).
    Thread-safe and process-safe; fork-safe (a child never uses the parent's
    open file descriptions).
    """

    def __init__(self, path: str, *, create: bool, access: Access) -> None:
        self.path = path
        self._anchor = self._open_anchor(path, create=create, access=access)
        self.inode = os.fstat(self._anchor).st_ino
        self._pid = os.getpid()
        self._local = threading.local()
        self._holders: list[_Holder] = []  # mutated in place: the finalizer holds it
        self._registry = threading.Lock()
        self._close = weakref.finalize(self, _close_all, [self._anchor], self._holders)

    @staticmethod
    def _open_anchor(path: str, *, create: bool, access: Access) -> int:
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        directory = os.path.dirname(path) or "."
        for _ in range(10):
            try:
                fd = -1
                if create:
                    try:
                        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
                    except FileExistsError:
                        pass
                    else:
                        try:
                            access.created(fd)
                        except BaseException:
                            os.close(fd)
                            raise
                        return fd
                fd = os.open(path, flags)
                try:
                    access.check_fd(fd, path)  # another user's lock file: never lock it
                except BaseException:
                    os.close(fd)
                    raise
                return fd
            except FileNotFoundError:
                if not os.path.isdir(directory):
                    # Containers and some CI runners have no /dev/shm at all; saying
                    # "create the store first" would send the user the wrong way.
                    raise CacheError(
                        f"{directory} does not exist: this host has no shared-memory"
                        " directory, so the memory tier cannot be used (mount a tmpfs"
                        " there, or pass memory=0)"
                    ) from None
                if not create:
                    raise CacheError(
                        f"no memory store at {path}: create it first (create=True)"
                    ) from None
                # Removed between our O_EXCL attempt and the plain open: try again.
            except CacheError:
                raise
            except OSError as exc:
                raise CacheError(f"cannot open the lock file {path}: {exc}") from exc
        raise CacheError(f"the lock file {path} keeps being removed while opening it")

    def unlinked(self) -> bool:
        """Whether the lock file path no longer names the inode this lock uses."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return True

    def _holder(self) -> _Holder:
        pid = os.getpid()
        holder: _Holder | None = getattr(self._local, "holder", None)
        if holder is not None and holder.pid == pid and holder.fd >= 0:
            return holder
        if pid != self._pid:
            self._after_fork(pid)
        if self._anchor < 0 or not self._close.alive:
            # Closed (or finalized by the garbage collector): the anchor's number may
            # already name another file, so never open /proc/self/fd/<anchor> again.
            raise CacheError(f"the lock {self.path} is closed")
        fd = os.open(f"/proc/self/fd/{self._anchor}", os.O_RDWR | os.O_CLOEXEC)
        holder = _Holder(fd, pid)
        self._local.holder = holder
        with self._registry:
            self._holders.append(holder)
        return holder

    def _after_fork(self, pid: int) -> None:
        # The inherited descriptors share open file descriptions (and so locks)
        # with the parent: close our copies, never lock through them.
        _close_all([], self._holders)
        self._registry = threading.Lock()
        self._local = threading.local()
        self._pid = pid

    @contextlib.contextmanager
    def hold(self, mode: int, *, timeout: float | None = None) -> Iterator[None]:
        """Hold the lock in ``mode`` (``SHARED``/``EXCLUSIVE``) for the ``with`` block.

        ``timeout`` (seconds) bounds the wait; ``None`` waits as long as a live
        holder holds it (a dead one releases it at once). Raises ``CacheError``
        on timeout.
        """
        h = self._holder()
        if h.depth:
            if mode == EXCLUSIVE and h.mode != EXCLUSIVE:
                raise RuntimeError(
                    "cannot write to a memory store inside a view() block of the same thread:"
                    " leave the block first"
                )
            h.depth += 1
            try:
                yield
            finally:
                h.depth -= 1
            return
        self._acquire(h.fd, mode, timeout)
        h.mode, h.depth = mode, 1
        try:
            yield
        finally:
            h.mode, h.depth = 0, 0
            fcntl.flock(h.fd, fcntl.LOCK_UN)

    def _acquire(self, fd: int, mode: int, timeout: float | None) -> None:
        if timeout is None:
            fcntl.flock(fd, mode)
            return
        try:  # the uncontended case: one system call, no clock read
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                raise
        deadline = time.monotonic() + timeout
        delay = 0.0001
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                holders = ", ".join(map(str, lock_holders(self.inode))) or "unknown"
                raise LockTimeout(
                    f"timed out after {timeout:.0f}s waiting for the lock {self.path}: a live"
                    f" process holds it (pids {holders}; a stopped one?); resume it"
                    " (kill -CONT) or end it"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.005 if timeout < OPEN_WAIT_POLL else 0.05)

    def try_exclusive(self) -> bool:
        """Take the exclusive lock without waiting; return whether it was taken.

        Pair with :meth:`release`. Used by scans that skip stores in use.
        """
        h = self._holder()
        if h.depth:
            raise RuntimeError("try_exclusive() inside a held section")
        try:
            fcntl.flock(h.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                return False
            raise
        h.mode, h.depth = EXCLUSIVE, 1
        return True

    def release(self) -> None:
        """Release a lock taken by :meth:`try_exclusive`."""
        h = self._holder()
        h.mode, h.depth = 0, 0
        fcntl.flock(h.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Close every descriptor of this process. Idempotent; call outside any section."""
        with self._registry:
            self._close()
        self._local = threading.local()
        self._anchor = -1

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or the garbage collector finalized the lock)."""
        return self._anchor < 0 or not self._close.alive
