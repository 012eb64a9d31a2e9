"""Publishing: entries appended to a pack in a spool file, the pack uploaded and its
index committed when it is full, idle, old, or the process flushes or exits.

The writer of a process owns one *open* pack: a spool file (under ``spool_dir``,
unique name) that entries are appended to with ``pwrite``, and the columns of its
index. A pack is *sealed* when it holds ``pack_bytes`` (or on :meth:`PackWriter.commit`:
a flush, the end of an epoch, ``close``, the process's exit, or ``linger`` seconds
without a new entry, which is how persistent DataLoader workers publish between
epochs), then uploaded and its index committed (:meth:`~mmcache.shared.access.Share.commit`).
Until its index is committed a pack is this process's alone: :meth:`PackWriter.read`
serves this process's own entries from the spool (a put is read back at once, as from
any store), and no other process sees them.

A failed upload or commit (the store cannot be reached, the share is full or not
ours to write) loses that pack only: reported to the tier (one warning per process),
the spool removed; the entries are produced again by whoever misses them. A process
killed at any moment leaves a spool file (removed by the next writer of this spool
folder once its process is gone) and at most a pack without an index (never read;
``mmcache gc --shared`` removes it).

Thread-safe: appends, reads and the commit take one lock; the upload runs outside it
(entries of a sealed pack stay readable from its spool until its index is in the
reader's merged index). Fork-aware: a forked child never touches its parent's packs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing import util

import numpy as np

from mmcache.errors import RemoteError
from mmcache.keys import KEY_SIZE
from mmcache.shared.access import Share
from mmcache.shared.layout import IndexArrays, encode_index, new_pack_name
from mmcache.stores.tiered import Row

__all__ = ["OpenPack", "PackWriter"]

logger = logging.getLogger(__name__)

_SPOOL_PREFIX = "mmcache-pack-"


@dataclass
class OpenPack:
    """A pack being filled (or sealed, uploading): its spool and its entries."""

    name: str
    fd: int
    path: str
    started: float
    size: int = 0
    last: float = 0.0
    rows: dict[bytes, tuple[int, int, float, float]] = field(default_factory=dict)

    def index(self, created: float) -> IndexArrays:
        """The index of what it holds now (the last value of each key)."""
        n = len(self.rows)
        keys = np.frombuffer(b"".join(self.rows), np.uint8).reshape(n, KEY_SIZE)
        cols = list(self.rows.values())
        return IndexArrays(
            keys=keys,
            offset=np.fromiter((c[0] for c in cols), np.uint64, n),
            size=np.fromiter((c[1] for c in cols), np.uint32, n),
            cost=np.fromiter((c[2] for c in cols), np.float32, n),
            ctime=np.fromiter((c[3] for c in cols), np.float64, n),
            pack_bytes=self.size,
            created=created,
        )

    def read(self, key: bytes) -> bytes | None:
        row = self.rows.get(key)
        if row is None:
            return None
        return os.pread(self.fd, row[1], row[0])

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


#: Told each committed pack and its index (the tier merges it into its index).
Committed = Callable[[str, IndexArrays], None]
#: Told what failed and why (the tier logs one warning per process, see its docstring).
Failed = Callable[[str, BaseException], None]


class PackWriter:
    """The publishing half of a shared tier in one process (see the module docstring)."""

    def __init__(
        self,
        share: Share,
        *,
        pack_bytes: int,
        linger: float,
        spool_dir: str | None,
        committed: Committed,
        failed: Failed,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.share = share
        self.pack_bytes = pack_bytes
        self.linger = linger
        self.spool_dir = spool_dir or tempfile.gettempdir()
        self._committed = committed
        self._failed = failed
        self.clock = clock
        self.wall = wall
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._commit_lock = threading.Lock()  # one upload at a time, in order
        self._open: OpenPack | None = None
        self._sealed: list[OpenPack] = []
        self._closed = False
        self._wake = threading.Event()
        self._timer: threading.Thread | None = None
        self._started = False  # the linger thread and the exit commit, once per process
        self.published = 0  # packs committed by this process

    # -- appending ---------------------------------------------------------------------------
    def append(self, rows: Sequence[Row]) -> None:
        """Append encoded ``(key, value, cost, ctime)`` rows to the open pack; a pack that
        reaches ``pack_bytes`` is sealed and committed here (the caller is the
        write-behind's background thread, or a warm-up: nobody waits on it)."""
        full = False
        with self._lock:
            if self._closed:
                return
            pack = self._open or self._new_pack()
            for key, value, cost, ctime in rows:
                os.pwrite(pack.fd, value, pack.size)
                pack.rows[key] = (pack.size, len(value), float(cost), float(ctime))
                pack.size += len(value)
            pack.last = self.clock()
            full = pack.size >= self.pack_bytes
        self._start_timer()
        if full:
            self.commit()

    def _new_pack(self) -> OpenPack:
        """Open the next pack's spool (the caller holds the lock)."""
        os.makedirs(self.spool_dir, exist_ok=True)
        _sweep_spools(self.spool_dir)
        fd, path = tempfile.mkstemp(
            prefix=f"{_SPOOL_PREFIX}{socket.gethostname()}-{os.getpid()}-", dir=self.spool_dir
        )
        pack = OpenPack(new_pack_name(), fd, path, started=self.clock())
        self._open = pack
        return pack

    def read(self, key: bytes) -> bytes | None:
        """This process's own entry for ``key`` not yet visible to others, or None."""
        with self._lock:
            for pack in (self._open, *reversed(self._sealed)):
                if pack is not None:
                    raw = pack.read(key)
                    if raw is not None:
                        return raw
        return None

    def holds(self, key: bytes) -> bool:
        """Whether an open or sealed pack of this process holds ``key``."""
        with self._lock:
            return any(p is not None and key in p.rows for p in (self._open, *self._sealed))

    def forget(self, key: bytes) -> bool:
        """Drop ``key`` from the open pack (its bytes stay in the spool, unindexed);
        whether an open or sealed pack held it (a sealed one is published as sealed)."""
        with self._lock:
            held = any(p is not None and key in p.rows for p in (self._open, *self._sealed))
            if self._open is not None:
                self._open.rows.pop(key, None)
            return held

    def pending(self) -> list[OpenPack]:
        """The open and sealed packs (a snapshot, for ``keys``/``info``)."""
        with self._lock:
            return [p for p in (*self._sealed, self._open) if p is not None]

    # -- committing --------------------------------------------------------------------------
    def commit(self) -> None:
        """Seal the open pack and publish every sealed one (upload, then index)."""
        if os.getpid() != self._pid:
            return  # a forked copy: these packs are the parent's to publish
        with self._commit_lock:
            with self._lock:
                if self._open is not None and self._open.rows:
                    self._sealed.append(self._open)
                    self._open = None
                todo = list(self._sealed)
            for pack in todo:
                self._publish(pack)
                with self._lock:
                    self._sealed.remove(pack)
                pack.discard()

    def _publish(self, pack: OpenPack) -> None:
        index = pack.index(self.wall())
        try:
            self.share.upload(pack.path, pack.name)
            self.share.commit(pack.name, encode_index(index))
        except (RemoteError, OSError) as exc:
            self._failed(f"a pack of {len(index)} entries not published", exc)
            return
        self.published += 1
        self._committed(pack.name, index)

    # -- lingering ---------------------------------------------------------------------------
    def _start_timer(self) -> None:
        """On the first append of this process: the linger thread, and a commit at the
        process's normal exit (DataLoader workers included: a ``multiprocessing``
        finalizer, run after the write-behind's own at priority 10)."""
        if self._started:
            return
        with self._lock:
            if self._started or self._closed:
                return
            self._started = True
            util.Finalize(self, self.close, exitpriority=5)
            if self.linger <= 0:
                return
            self._timer = threading.Thread(
                target=self._linger, name="mmcache-shared-publish", daemon=True
            )
            self._timer.start()

    def _linger(self) -> None:
        """Commit the open pack once it has had no new entry for ``linger`` seconds."""
        step = max(min(self.linger / 2, 1.0), 0.01)
        while not self._wake.wait(step):
            with self._lock:
                pack = self._open
                idle = pack is not None and bool(pack.rows)
                idle = idle and pack is not None and self.clock() - pack.last >= self.linger
            if idle:
                try:
                    self.commit()
                except Exception:  # a publishing failure must never kill the thread
                    logger.exception("shared tier %s: publishing failed", self.share.url)

    def close(self) -> None:
        """Commit what is left and stop (idempotent; later appends are dropped)."""
        self.commit()
        with self._lock:
            self._closed = True
        self._wake.set()
        timer = self._timer
        if timer is not None and timer is not threading.current_thread() and timer.is_alive():
            timer.join(5.0)

    def abandon(self) -> None:
        """Forget the packs (a forked child's copy of its parent's writer: the parent's)."""
        self._open = None
        self._sealed = []
        self._timer = None
        self._started = False
        self._lock = threading.Lock()
        self._commit_lock = threading.Lock()
        self._wake = threading.Event()


def _sweep_spools(folder: str) -> None:
    """Remove spool files of this host's processes that are gone (killed writers)."""
    host = socket.gethostname()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not name.startswith(f"{_SPOOL_PREFIX}{host}-"):
            continue
        pid = name.removeprefix(f"{_SPOOL_PREFIX}{host}-").partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
