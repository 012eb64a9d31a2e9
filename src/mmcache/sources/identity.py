"""The identity of a sample's bytes: the one model every source keys its samples by.

A sample's cache key is its pipeline's fingerprint plus the *identity of the bytes it was
made from* (:func:`mmcache.keys.sample_key`). This module says what that identity is, so
that every source gets the same promises:

- **Equal wherever the same bytes are.** One shared file system, or node-local copies made
  with ``cp -a``/``rsync -a``/``tar x``: the same relative names and the same bytes give the
  same keys on every node, so ``scope="cluster"`` can exchange entries between nodes that
  each read their own copy, and a disk tier copied to another machine stays warm.
- **Different whenever the bytes differ.** Two datasets with the same relative names, sizes
  and mtimes but other pixels (fixed-size BMP or ``.npy`` files, archives extracted with
  their mtimes) share no entry; a rewrite that restores the size and the mtime
  (``touch -d``, ``cp -p``) is fresh at the next key computation.
- **Never a new key for unchanged bytes.** A ``chmod``, a new hard link, a ``cp -a`` or a
  remount changes a file's local evidence but not its identity.

How: the identity of a local file (or of a byte span of a local shard) is the xxh3_128 of
its bytes, ``"xxh3:<32 hex>"``, exactly what ``content_stamp=True`` always computed. Reading
every file for every key would cost what ``content_stamp=True`` costs, so each digest is
remembered in a node-local :class:`Ledger` under the file's **local evidence**: its absolute
path and :func:`mmcache.keys.stat_fields` (size, mtime, ctime, inode). The ctime is set by
every write, ``utime``, rename and ``chmod`` and cannot be set back, so while the evidence
is unchanged the bytes are unchanged and the remembered digest is served after one
``stat``; when any of it changes (a rewrite with size and mtime restored changes the ctime)
the file is read and digested again: a content check, never a stale key and never a new key
for bytes that did not change. ``content_stamp=True`` skips the ledger and digests every
time (for file systems whose ctimes or inode numbers cannot be trusted).

**Racy stamps** (git's "racy index" problem). A same-size rewrite within one tick of the
file system's clock keeps all four fields: 1 s on ext2/ext3 with 128-byte inodes, HFS+ and
some NFS servers, 2 s on FAT, a jiffy for ctimes on kernels before 6.13. Evidence alone
then cannot tell "unchanged" from "rewritten just after its digest was taken", so a digest
vouches for its evidence only when the file's last change (the later of its mtime and
ctime) is at least :data:`RACY_SECONDS` older than the moment its bytes began to be read
(the ledger's ``clock``): any rewrite after that moment falls in a later tick and changes
the ctime. A digest taken sooner is kept with its time but never served: the file is read
again at each key computation until its stamp is old enough, then remembered as usual.
Files older than that (the common case) cost one ``stat`` each as before; a file stamped in
the future is read at each key computation until that time has passed (one warning per
process: a file server's clock ahead of this node's, or a ``tar x`` of future mtimes). A
file server's clock *behind* this node's by more than about a second defeats the margin:
there, use ``content_stamp=True``. Rejected: git's own test, a stamp not older than the
index file's mtime (the ledger lives on another file system than the data, with another
clock and granularity), and the ctime alone (FAT-like file systems report a creation time
there; only the mtime moves).

Rejected alternatives: keys from ``(size, mtime, ctime, inode)`` (turn 2) are never stale but
differ on every copy (G17: the cluster refused every exchanged entry); keys from
``(size, mtime)`` are equal on copies but serve another dataset's or an old version's pixels
(G4). A digest is the only identity that is both; the ledger makes it cost a ``stat``.

The ledger is an SQLite file (stdlib ``sqlite3``: process-safe, crash-safe, no server) per
node, in ``$MMCACHE_IDENTITY_DIR`` (default ``$XDG_CACHE_HOME/mmcache/identity``), named by
the host so that a home directory shared between nodes never has two nodes lock one file.
``MMCACHE_IDENTITY_DIR=off`` keeps it in memory (one per process: every process digests
what it keys once). It holds only digests of bytes this node read; losing it, or any error
reading or writing it, costs a re-read, never a wrong key (one warning, then in memory). A
damaged ledger (SQLite finds no database, or a malformed page) is rebuilt instead: the
first process to meet it, holding ``<ledger>.lock``, moves it aside to ``<ledger>.damaged``
(replacing an older one) and starts an empty one, with one warning; other processes find
the new file and go on (a process rebuilds at most once; if it fails, it stays in memory).

Each row keeps what it was learned from (the file's path, its stat fields, the span) and
when. **No bound on the rows**: a ledger holds a row per file (or shard span) of the
datasets in use, 10^8 of them if need be (~180 B each), and a row of a file that did not
change is never dropped (dropping it costs a re-read of the file at the next key: 10^8
photos, ~10 TB). Pruning is lazy instead: when a file's new digest is learned, the rows of
that path under other evidence go (a rewritten file can never match them again: found
by a hash of the path, indexed); ``mmcache gc`` (:func:`prune_ledger`) checks at most
:data:`PRUNE_BUDGET` rows (one ``stat`` per distinct file among them: a shard's spans
share one) for files gone or changed, continuing where the last ``gc`` stopped, so that
every row is checked in turn and no ``gc`` stats every row (10^8 of them: 14 hours at a
network file system's 0.5 ms). A ledger (or its folder) owned by another user, or a link,
is never used, pruned nor rebuilt (:func:`check_ledger_owner`). A ledger of schema 2 gets
the path hash column in place (its rows kept: only the lazy pruning misses them, ``gc``
does not); one of an older schema (rows without their paths) is emptied when first
opened: it costs one re-read of each file.

Remote objects are identified by their ETag or version id (:mod:`mmcache.sources.blobs`).

Thread/process safety: :func:`ledger` returns one ledger per process (re-opened in a forked
child); its methods take an internal lock, and SQLite serialises processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import socket
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache import keys
from mmcache.errors import CacheError
from mmcache.stores.memory.access import describe_owner

__all__ = [
    "CONTENT_PREFIX",
    "MAX_DIGEST_BYTES",
    "PRUNE_BUDGET",
    "RACY_SECONDS",
    "Ledger",
    "LedgerReport",
    "check_ledger_owner",
    "content_digest",
    "evidence",
    "file_identities",
    "file_identity",
    "ledger",
    "ledger_file",
    "ledger_report",
    "prune_ledger",
    "racy_rows",
    "span_identities",
]

logger = logging.getLogger(__name__)

#: Every identity of bytes starts with this; ``keys.source_stamp(content=True)`` makes the same.
CONTENT_PREFIX = "xxh3:"
_CHUNK = 1 << 20
#: Files larger than this are not digested for a key (far over any image's ``max_bytes``):
#: their identity is their local evidence. Sources of big files (Parquet) pass their own.
MAX_DIGEST_BYTES = 1 << 30
#: Rows one ``mmcache gc`` checks (one ``stat`` per distinct file among them), continuing
#: where the last one stopped: 0.3 s locally, 50 s at a network file system's 0.5 ms.
PRUNE_BUDGET = 100_000
#: A digest vouches for a file's evidence only when the file's last change (mtime or ctime,
#: the later) is this much older than the moment its bytes began to be read (see "Racy
#: stamps" above): the coarsest timestamps met (FAT's 2 s) plus a coarse clock's lag and
#: about a second of skew between this node's clock and a file server's.
RACY_SECONDS = 3.0
#: Digests a process keeps in memory beside a usable ledger file (the newest; ~13 MB):
#: its memory stays bounded whatever the dataset's size. In memory only (no file, or
#: one that failed) every digest is kept: nothing else remembers it.
MEM_ROWS = 1 << 16
#: The table's layout (``PRAGMA user_version``): schema 2 is brought to it in place, a
#: ledger of another one is emptied.
_SCHEMA = 3
_TABLE = (
    "CREATE TABLE IF NOT EXISTS digest (ev BLOB PRIMARY KEY, d BLOB NOT NULL,"
    " path BLOB NOT NULL, size INT, mtime INT, ctime INT, ino INT, lo INT, hi INT,"
    " t REAL NOT NULL, ph INT) WITHOUT ROWID"
)  # t: when the digest's bytes began to be read (seconds since the epoch); ph: _path_hash
#: By path hash and ctime: a file's rows of other versions are found without visiting its
#: rows of this one (a shard's ten thousand spans).
_PATH_INDEX = "CREATE INDEX IF NOT EXISTS digest_ph_ctime ON digest (ph, ctime)"
#: Where the last ``gc`` stopped checking rows (key ``prune_after``: an evidence key).
_META = "CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v BLOB) WITHOUT ROWID"
_COLUMNS = "ev, d, path, size, mtime, ctime, ino, lo, hi, t, ph"
#: A path's rows of other versions of the file: another ctime (every write, ``utime``,
#: rename and ``chmod`` sets it, never back), earlier or later, each a range of the index.
#: A row of the same ctime but other fields (a same-tick rewrite on a coarse clock) is
#: left to ``gc``'s check: its evidence cannot match either.
_OLDER = (
    "DELETE FROM digest WHERE ph = ? AND ctime < ? AND path = ?",
    "DELETE FROM digest WHERE ph = ? AND ctime > ? AND path = ?",
)
#: SQLite's primary result codes of a damaged file: "database disk image is malformed" and
#: "file is not a database" (``sqlite3.SQLITE_CORRUPT``/``SQLITE_NOTADB`` from Python 3.11).
_DAMAGED_CODES = frozenset({11, 26})
#: :meth:`Ledger.vouches` in SQL, on a row's own stamp and time (the racy margin in ns bound
#: last): in the query, so that a racy row costs the batch no Python (~0.8 us a key).
_VOUCHES = "max(mtime, ctime) + ? <= t * 1e9"
#: Most keys of one ledger query (SQLite's bound parameters: at least 999 everywhere).
_IN_KEYS = 500
#: One row a ledger learns: ``(evidence, digest, path, stat fields, span or None)``.
Learned = tuple[bytes, bytes, str | bytes, Sequence[int], tuple[int, int] | None]


def content_digest(data: bytes | memoryview) -> str:
    """The identity of ``data``: ``"xxh3:<32 hex>"`` of its bytes."""
    return CONTENT_PREFIX + xxhash.xxh3_128_hexdigest(data)


def evidence(path: str | bytes, fields: Sequence[int], *extra: int) -> bytes:
    """The 16-byte ledger key of ``path`` as ``stat`` saw it (``fields``: its
    :func:`~mmcache.keys.stat_fields`), plus ``extra`` (a byte span's offsets)."""
    where = os.fsencode(os.path.abspath(path))
    return keys.digest("mmcache.evidence", where, *(int(f) for f in fields), *extra)


#: Connections a forked child inherited: referenced so that they are never closed there.
_INHERITED: list[sqlite3.Connection] = []


class Ledger:
    """Remembered digests, by local evidence (see the module docstring).

    ``path=None``: in memory only. Otherwise an SQLite file, opened lazily once per
    process. A damaged file is rebuilt (once per process); every other failure of the
    file (full disk, locked database, another user's file) logs one warning and continues
    in memory: the ledger is a cost saver, never a source of truth.

    ``clock`` (seconds since the epoch, comparable with file timestamps: ``time.time`` or
    a test's fake) dates each digest when :meth:`put_many` is not told when it was taken;
    ``racy_s`` is :data:`RACY_SECONDS`. :meth:`get_many` serves a digest only when its file's
    stamp was that much older than the digest (see "Racy stamps" in the module docstring).

    Thread-safe (one internal lock); process-safe through SQLite, and a rebuild is
    serialised between processes by an ``flock`` on ``<path>.lock``.
    """

    def __init__(
        self,
        path: str | None,
        *,
        clock: Callable[[], float] = time.time,
        racy_s: float = RACY_SECONDS,
    ) -> None:
        self.path = path
        self.clock = clock
        self._racy_ns = int(racy_s * 1e9)
        self._lock = threading.Lock()
        self._mem: dict[bytes, bytes] = {}  # only digests that vouch for their evidence
        self._conn: sqlite3.Connection | None = None
        self._opened: tuple[int, int] | None = None  # (st_dev, st_ino) that _conn reads
        self._pid = -1
        self._failed = path is None
        self._rebuilt = False
        self._told_future = False

    def vouches(self, mtime_ns: int, ctime_ns: int, taken: float) -> bool:
        """Whether a digest whose bytes began to be read at ``taken`` (seconds since the
        epoch) may stand for a file stamped ``mtime_ns``/``ctime_ns``: its last change
        was at least ``racy_s`` before, so no rewrite since can have kept the stamp."""
        return max(int(mtime_ns), int(ctime_ns)) + self._racy_ns <= taken * 1e9  # as _VOUCHES

    def _tell_future_locked(self, path: str | bytes, fields: Sequence[int], when: float) -> None:
        """One warning per process for a file stamped in the future: it is read at every key
        computation until then (a silent cost otherwise)."""
        ahead = max(int(fields[1]), int(fields[2])) / 1e9 - when
        if ahead > self._racy_ns / 1e9:
            self._told_future = True
            logger.warning(
                "%s is stamped %.0f s in the future (its mtime or ctime): a file is read at"
                " each key computation until its stamp is %.0f s old (a file server's clock"
                " ahead of this node's, or files extracted with future mtimes; samples are"
                " keyed correctly)",
                os.fsdecode(path),
                ahead,
                self._racy_ns / 1e9,
            )

    def _connection_locked(self) -> sqlite3.Connection | None:
        if self._failed or self.path is None:
            return None
        if self._pid != os.getpid():
            # A connection is never used across fork (SQLite's rule): the child opens its own
            # and leaves the inherited one alone, never even closing it (kept referenced).
            if self._conn is not None:
                _INHERITED.append(self._conn)
            self._conn, self._pid = None, os.getpid()
        if self._conn is None:
            seen = None
            try:
                os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
                check_ledger_owner(self.path)
                seen = _file_id(self.path)
                conn = _open_ledger(self.path)
            except (OSError, sqlite3.Error, CacheError) as exc:
                self._opened = seen
                return self._recover_locked(exc)
            self._conn, self._opened = conn, seen or _file_id(self.path)
        return self._conn

    def _recover_locked(self, exc: BaseException) -> sqlite3.Connection | None:
        """After ``exc`` from the ledger file: a connection to a rebuilt ledger when the
        file is damaged (at most once per process), else None (one warning; in memory
        from now on)."""
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None
        if self.path is None or self._rebuilt or not _damaged(exc):
            self._fail(exc)
            return None
        self._rebuilt = True
        try:
            conn, self._opened, aside = _rebuild_ledger(self.path, self._opened)
        except (OSError, sqlite3.Error, CacheError) as again:
            self._fail(again)
            return None
        if aside is not None:
            _warn_rebuilt(self.path, aside, exc)
        self._conn = conn
        return conn

    def _fail(self, exc: BaseException) -> None:
        logger.warning(
            "the identity ledger %s cannot be used (%s): digests are kept in memory by "
            "this process only (samples are keyed correctly; files are read once more "
            "per process)",
            self.path,
            exc,
        )
        self._failed = True
        self._conn = None

    def _run_locked(self, op: Callable[[sqlite3.Connection], None]) -> None:
        """``op(connection)`` on the ledger file, if it can be used; after an error, once
        more on the rebuilt file when the error was damage (see :meth:`_recover_locked`)."""
        conn = self._connection_locked()
        while conn is not None:
            try:
                op(conn)
                return
            except sqlite3.Error as exc:
                conn = self._recover_locked(exc)  # a connection at most once

    def get_many(self, evs: Sequence[bytes]) -> list[bytes | None]:
        """The remembered 16-byte digest of each evidence key that vouches for it (see
        :meth:`vouches`), or None."""
        with self._lock:
            found = {ev: self._mem[ev] for ev in evs if ev in self._mem}
            missing = [ev for ev in evs if ev not in found]

            def select(conn: sqlite3.Connection) -> None:
                # One query per _IN_KEYS keys (a new process's first epoch asks for every
                # file of each batch: one statement per key cost ~15 us each, one per batch
                # ~2 us a key). The SQL text holds only placeholders, never data; the keys
                # are bound parameters.
                cur, got = conn.cursor(), {}
                for at in range(0, len(missing), _IN_KEYS):
                    part = missing[at : at + _IN_KEYS]
                    marks = ",".join("?" * len(part))
                    sql = f"SELECT ev, d FROM digest WHERE ev IN ({marks}) AND {_VOUCHES}"  # noqa: S608
                    for ev, d in cur.execute(sql, [*part, self._racy_ns]):
                        got[bytes(ev)] = bytes(d)
                found.update(got)  # none of a query that failed part way (a damaged file)

            if missing:
                self._run_locked(select)
            return [found.get(ev) for ev in evs]

    def put_many(self, items: Sequence[Learned], *, taken: float | None = None) -> None:
        """Remember ``(evidence, digest, path, fields, span)`` rows (one transaction), as
        digests whose bytes began to be read at ``taken`` (default: now, by ``clock``).
        A row whose stamp is too recent for its digest to vouch for it is stored with its
        time but not served (:meth:`vouches`); the next key computation reads the file."""
        if not items:
            return
        when = self.clock() if taken is None else taken
        with self._lock:
            for ev, d, path, fields, _ in items:
                if self.vouches(fields[1], fields[2], when):
                    self._mem[ev] = d
                elif not self._told_future:
                    self._tell_future_locked(path, fields, when)
            rows = []
            versions: dict[bytes, tuple[int, ...]] = {}  # path -> its stat fields now
            for ev, d, path, fields, span in items:
                where = os.fsencode(os.path.abspath(path))
                now = tuple(int(f) for f in fields)
                versions[where] = now
                lo_hi = span if span is not None else (None, None)
                rows.append((ev, d, where, *now, *lo_hi, when, _path_hash(where)))
            older = [(_path_hash(p), now[2], p) for p, now in versions.items()]

            def insert(conn: sqlite3.Connection) -> None:
                with conn:  # the rows of the files' other versions go: lazy pruning
                    for sql in _OLDER:
                        conn.executemany(sql, older)
                    conn.executemany(
                        f"INSERT OR REPLACE INTO digest ({_COLUMNS})"  # noqa: S608 - no data
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        rows,
                    )

            self._run_locked(insert)
            if not self._failed and len(self._mem) > MEM_ROWS:
                # The file holds every row: this process keeps only its newest ones (a
                # digest per file it read, ~200 B each, made a worker's memory grow with
                # the dataset); an older one is found in the file when asked again.
                for ev in list(itertools.islice(self._mem, len(self._mem) - MEM_ROWS // 2)):
                    del self._mem[ev]


def _path_hash(path: bytes) -> int:
    """The signed 64-bit hash of an absolute path by which its rows are found (indexed)."""
    return int.from_bytes(xxhash.xxh3_64_digest(path), "little", signed=True)


def _open_ledger(path: str) -> sqlite3.Connection:
    """A connection to the ledger file ``path`` (made if absent), in the current schema."""
    conn = sqlite3.connect(path, timeout=30, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    if conn.execute("PRAGMA user_version").fetchone()[0] != _SCHEMA:
        _upgrade(conn)
    return conn


def _upgrade(conn: sqlite3.Connection) -> None:
    """Bring the ledger to the current schema, under a write lock (the ranks of a job
    open it at once: one upgrades, the others find it done): schema 2 gets the path hash
    column and its index (its rows kept), any other is emptied (its rows lack their
    paths: gc could never prune them)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == 2:
            conn.execute("ALTER TABLE digest ADD COLUMN ph INT")
        elif version != _SCHEMA:
            conn.execute("DROP TABLE IF EXISTS digest")
            conn.execute(_TABLE)
        conn.execute(_PATH_INDEX)
        conn.execute(_META)
        conn.execute(f"PRAGMA user_version = {_SCHEMA}")
        conn.commit()
    except BaseException:
        conn.rollback()
        raise


def _file_id(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the file at ``path`` (links not followed), None if absent."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _damaged(exc: BaseException) -> bool:
    """Whether ``exc`` says the ledger file is damaged (not busy, full, read-only...)."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _DAMAGED_CODES
    # Python 3.10 has no result code: its sqlite3 raises DatabaseError itself only for a
    # damaged file (SQLITE_CORRUPT, SQLITE_NOTADB, SQLITE_FORMAT) and a subclass otherwise.
    return type(exc) is sqlite3.DatabaseError


def _rebuild_ledger(
    path: str, damaged: tuple[int, int] | None
) -> tuple[sqlite3.Connection, tuple[int, int] | None, str | None]:
    """Replace the damaged ledger file ``path`` (the file ``damaged``: ``(st_dev, st_ino)``)
    by an empty one: ``(connection, its file's id, where the damaged one went or None)``.

    Under an ``flock`` on ``<path>.lock``, so that of several processes that met the damage
    one moves it aside and the others (finding another file at ``path``, or none) open the
    new one. The -wal and -shm files go first, so that no process pairs the old WAL with
    the new file. Another user's file, a link, or a folder not ours is never touched
    (:func:`check_ledger_owner` raises CacheError)."""
    with _ledger_lock(path):
        check_ledger_owner(path)
        aside = None
        if damaged is not None and _file_id(path) == damaged:
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path + suffix)
            aside = path + ".damaged"
            os.replace(path, aside)
        conn = _open_ledger(path)
        return conn, _file_id(path), aside


@contextlib.contextmanager
def _ledger_lock(path: str, wait_s: float = 30.0) -> Iterator[None]:
    """An exclusive ``flock`` on ``<path>.lock`` (made 0600 if absent; never through a link,
    never another user's), given up after ``wait_s`` (CacheError: a holder stopped)."""
    where = path + ".lock"
    fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _refuse_unless_own(where, os.fstat(fd), want_dir=False)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CacheError(
                        f"the identity ledger lock {where} was held for over {wait_s:.0f} s:"
                        " the damaged ledger is not rebuilt by this process (a process"
                        " holding it may be stopped)"
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


def _warn_rebuilt(path: str, aside: str, exc: BaseException) -> None:
    logger.warning(
        "the identity ledger %s was damaged (%s): moved aside to %s (safe to delete) and"
        " started afresh; files are read once more to learn their digests again",
        path,
        exc,
        aside,
    )


def check_ledger_owner(path: str) -> None:
    """Raise :class:`~mmcache.errors.CacheError` unless the ledger file ``path`` (if it
    exists) and its folder are this user's own, not links: a ledger another user could
    write would hand this user's jobs the keys of bytes they never read."""
    for where, want_dir in ((os.path.dirname(path), True), (path, False)):
        try:
            st = os.lstat(where)
        except FileNotFoundError:
            continue
        _refuse_unless_own(where, st, want_dir=want_dir)


def _refuse_unless_own(where: str, st: os.stat_result, *, want_dir: bool) -> None:
    """CacheError unless ``st`` (of ``where``) is a folder (``want_dir``) or a regular file
    of this user: never a link, never another uid's."""
    me = os.geteuid()
    kind_ok = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    if st.st_uid == me and kind_ok:
        return
    what = "folder" if want_dir else "file"
    raise CacheError(
        f"refusing the identity ledger {what} {where}: it has {describe_owner(st)}, but"
        f" mmcache uses and prunes only a regular {what} of uid {me} (not a link). Set"
        " MMCACHE_IDENTITY_DIR to a folder of your own (or 'off' to keep digests in"
        " memory), or remove it as its owner"
    )


_LEDGERS: dict[str | None, Ledger] = {}
_LEDGERS_LOCK = threading.Lock()
_MEMORY_ONLY = [0]  # depth of memory_only() blocks in this process


@contextlib.contextmanager
def memory_only() -> Iterator[None]:
    """Within the block, this process's digests are remembered in memory only: the ledger
    file is neither created nor written (what ``mmcache inspect`` needs to write nothing).
    Process-wide while it lasts; for commands, not for threads of a training job."""
    _MEMORY_ONLY[0] += 1
    try:
        yield
    finally:
        _MEMORY_ONLY[0] -= 1


def _ledger_path() -> str | None:
    return None if _MEMORY_ONLY[0] else ledger_file()


def ledger_file() -> str | None:
    """Where this user's ledger on this node is (``$MMCACHE_IDENTITY_DIR``, default
    ``$XDG_CACHE_HOME/mmcache/identity/<host>-<uid>.sqlite``), or None when it is off."""
    where = os.environ.get("MMCACHE_IDENTITY_DIR")
    if where is not None and where.strip().lower() in ("", "off", "none", "0"):
        return None
    if not where:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        where = os.path.join(base, "mmcache", "identity")
    host = "".join(c if c.isalnum() or c in "-._" else "_" for c in socket.gethostname())
    return os.path.join(where, f"{host or 'host'}-{os.getuid()}.sqlite")


def ledger() -> Ledger:
    """This process's ledger (``$MMCACHE_IDENTITY_DIR``, read when first asked for a path)."""
    path = _ledger_path()
    with _LEDGERS_LOCK:
        got = _LEDGERS.get(path)
        if got is None:
            got = _LEDGERS[path] = Ledger(path)
        return got


def _digest_file(path: str | bytes, want: Sequence[int], max_bytes: int | None) -> tuple[str, bool]:
    """``(identity, stable)``: the digest of the file's bytes, and whether the file's
    evidence was ``want`` before and after the read (only then is it remembered).

    Hostile files are bounded before a byte is read: the file is opened non-blocking (a
    FIFO never blocks here) and one that is not a regular file, or is over ``max_bytes``
    (a 1 TiB sparse "image"), is not read: its identity is its local evidence
    (``"stat:..."``), never stale, and the sample's load refuses it with the real reason."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb", closefd=True) as fh:
        st = os.fstat(fd)
        before = keys.stat_fields(st)
        if not stat.S_ISREG(st.st_mode) or (max_bytes is not None and st.st_size > max_bytes):
            return "stat:" + keys.fields_stamp(before), False
        hasher = xxhash.xxh3_128()
        while chunk := fh.read(_CHUNK):
            hasher.update(chunk)
        after = keys.stat_fields(os.fstat(fd))
    stable = before == after == tuple(int(f) for f in want)
    return CONTENT_PREFIX + hasher.hexdigest(), stable


def file_identities(
    paths: Sequence[str | bytes | None],
    fields: np.ndarray,
    *,
    content: bool = False,
    max_bytes: int | None = MAX_DIGEST_BYTES,
) -> list[str]:
    """The identity of each file (see the module docstring), for key computation.

    ``fields``: ``int64 [n, 4]``, each file's :func:`~mmcache.keys.stat_fields` taken just
    before (``-2`` where none: no path, missing, unreadable). Rows without fields get
    :func:`mmcache.keys.source_stamp`'s ``"none"``, ``"missing"`` or ``"error:..."``.
    ``content=True`` reads every file (nothing taken from the ledger). A file over
    ``max_bytes``, or not a regular file, is never read (see :func:`_digest_file`).
    """
    out: list[str | None] = [None] * len(paths)
    evs: dict[int, bytes] = {}
    for j, path in enumerate(paths):
        if path is None or int(fields[j, 0]) == -2:
            out[j] = _unstamped(path)
        else:
            evs[j] = evidence(path, fields[j].tolist())
    book = ledger()
    known = book.get_many(list(evs.values())) if evs and not content else [None] * len(evs)
    learned: list[Learned] = []
    taken = book.clock()  # before any byte below is read: what a digest may vouch for
    for (j, ev), got in zip(evs.items(), known, strict=True):
        if got is not None:
            out[j] = CONTENT_PREFIX + got.hex()
            continue
        path = paths[j]
        assert path is not None
        try:
            ident, stable = _digest_file(path, fields[j].tolist(), max_bytes)
        except (OSError, ValueError):
            out[j] = _unstamped(path)  # vanished or unreadable since the stat
            continue
        out[j] = ident
        if stable:
            digest = bytes.fromhex(ident[len(CONTENT_PREFIX) :])
            learned.append((ev, digest, path, fields[j].tolist(), None))
    book.put_many(learned, taken=taken)
    return [s if s is not None else "missing" for s in out]


def racy_rows(fields: npt.NDArray[np.int64], taken: float) -> npt.NDArray[np.bool_]:
    """Rows of :func:`~mmcache.keys.stat_fields` (``int64 [n, 4]``) whose file changed
    (later of mtime and ctime) less than
    :data:`RACY_SECONDS` before ``taken``: bytes read since
    do not vouch for the stamp (:meth:`mmcache.sources.chassis.BaseSource._unsettled`)."""
    last = np.maximum(fields[:, 1], fields[:, 2])
    young: npt.NDArray[np.bool_] = last + int(RACY_SECONDS * 1e9) > int(taken * 1e9)
    return young


def _unstamped(path: str | bytes | None) -> str:
    """Why a file has no identity: ``"none"`` (no file), ``"missing"`` or ``"error:<ERRNO>"``
    (:func:`mmcache.keys.source_stamp`'s words; the sample's load reports the real error)."""
    if path is None:
        return "none"
    stamp = keys.source_stamp(os.fsdecode(path))
    if stamp in ("none", "missing") or stamp.startswith("error:"):
        return stamp
    return "error:changed"  # it appeared between the caller's stat and now


def file_identity(path: str | os.PathLike[str] | None, *, content: bool = False) -> str:
    """:func:`file_identities` of one file (one ``stat``)."""
    if path is None:
        return "none"
    p = os.fspath(path)
    try:
        row = np.array([keys.stat_fields(os.stat(p))], dtype=np.int64)
    except (OSError, ValueError):
        return _unstamped(p)
    return file_identities([p], row, content=content)[0]


def span_identities(
    path: str | bytes,
    fields: Sequence[int],
    spans: Sequence[tuple[int, int]],
    read: Callable[[int, int], bytes],
) -> list[str]:
    """The identity of byte spans ``[start, end)`` of one local file (a shard's members),
    remembered under the file's evidence and the span; ``read(start, end)`` reads one.

    The caller checks that the file's evidence is still ``fields`` after reading (a shard
    rewritten meanwhile is indexed again and its spans keyed again)."""
    evs = [evidence(path, fields, start, end) for start, end in spans]
    book = ledger()
    known = book.get_many(evs)
    out: list[str] = []
    learned: list[Learned] = []
    taken = book.clock()  # before any span below is read
    for ev, (start, end), got in zip(evs, spans, known, strict=True):
        digest = got
        if digest is None:
            digest = xxhash.xxh3_128_digest(read(start, end))
            learned.append((ev, digest, path, fields, (start, end)))
        out.append(CONTENT_PREFIX + digest.hex())
    book.put_many(learned, taken=taken)
    return out


@dataclass(frozen=True)
class LedgerReport:
    """Where the ledger is and what it holds (``path`` None: off); what a prune removed."""

    path: str | None
    exists: bool = False
    rows: int = 0
    bytes: int = 0  # the file and its WAL
    gone: int = 0  # rows of files that no longer exist (or cannot be read)
    changed: int = 0  # rows of files whose stat fields changed since
    over: int = 0  # rows removed for a bound: none since there is none (the reports' shape)
    checked: int = 0  # rows whose file this prune stat-ed (at most PRUNE_BUDGET)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        if self.path is None:
            return "identity ledger: off (MMCACHE_IDENTITY_DIR=off: digests kept in memory)"
        if not self.exists:
            return f"identity ledger: {self.path} (not made yet)"
        from mmcache.units import format_size

        return f"identity ledger: {self.path} ({self.rows} rows, {format_size(self.bytes)})"


def _file_bytes(path: str) -> int:
    total = 0
    for p in (path, path + "-wal"):
        with contextlib.suppress(OSError):
            total += os.stat(p).st_size
    return total


def ledger_report(path: str | None = None) -> LedgerReport:
    """Where the ledger is (``path``, default :func:`ledger_file`), its rows and bytes;
    read-only (nothing is made). CacheError for a ledger of another user."""
    path = ledger_file() if path is None else path
    if path is None:
        return LedgerReport(None)
    check_ledger_owner(path)
    if not os.path.exists(path):
        return LedgerReport(path)
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
        try:
            rows = int(conn.execute("SELECT count(*) FROM digest").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.Error:
        rows = 0  # an empty or older file: the next job makes its table
    return LedgerReport(path, True, rows, _file_bytes(path))


def prune_ledger(path: str | None = None, *, budget: int | None = None) -> LedgerReport:
    """Check at most ``budget`` rows (default :data:`PRUNE_BUDGET`) of ledger ``path``
    (default :func:`ledger_file`), from where the last prune stopped, and remove those
    whose file is gone or changed (one ``stat`` per distinct file: their evidence can
    never match again); rows of files that did not change are kept, however many. What
    is left, and what was removed. A damaged ledger is rebuilt empty, as a job would (one
    warning; see the module docstring).

    Safe while jobs use the ledger (SQLite serialises the writers; a row removed under
    a job costs it one re-read). CacheError for a ledger of another user, never touched.
    """
    path = ledger_file() if path is None else path
    if path is None or not os.path.exists(path):
        return ledger_report(path)
    check_ledger_owner(path)
    seen = _file_id(path)
    try:
        conn = _open_ledger(path)
        try:
            gone, changed, checked = _prune_rows(conn, PRUNE_BUDGET if budget is None else budget)
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        if not _damaged(exc):
            raise
        conn, _, aside = _rebuild_ledger(path, seen)
        conn.close()
        if aside is not None:
            _warn_rebuilt(path, aside, exc)
        return ledger_report(path)
    got = ledger_report(path)
    return LedgerReport(path, True, got.rows, got.bytes, gone, changed, 0, checked)


_ROW = "SELECT ev, path, size, mtime, ctime, ino FROM digest"


def _prune_rows(conn: sqlite3.Connection, budget: int) -> tuple[int, int, int]:
    """:func:`prune_ledger`'s work on an open ledger: ``(gone, changed, checked)``. The
    rows are visited in key order (random with respect to their files), from the key
    after the one the last prune stopped at, wrapping to the start; the next prune goes
    on from the last row checked (from the start once a pass is whole)."""
    found = conn.execute("SELECT v FROM meta WHERE k = 'prune_after'").fetchone()
    after = bytes(found[0]) if found else b""
    rows = conn.execute(f"{_ROW} WHERE ev > ? ORDER BY ev LIMIT ?", (after, budget)).fetchall()
    if len(rows) < budget and after:  # the end of the keys: on from the start
        rest = budget - len(rows)
        sql = f"{_ROW} WHERE ev <= ? ORDER BY ev LIMIT ?"
        rows += conn.execute(sql, (after, rest)).fetchall()
    stale: dict[str, list[bytes]] = {"gone": [], "changed": []}
    now: dict[bytes, list[int] | None] = {}  # one stat per file: a shard's spans share one
    for ev, raw, *fields in rows:
        where = bytes(raw)
        if where not in now:
            try:
                now[where] = list(keys.stat_fields(os.stat(where)))
            except OSError:
                now[where] = None
        if now[where] is None:
            stale["gone"].append(ev)
        elif now[where] != fields:
            stale["changed"].append(ev)
    whole = len(rows) < budget  # every row was checked: the next pass starts afresh
    with conn:
        for evs in stale.values():
            conn.executemany("DELETE FROM digest WHERE ev = ?", [(ev,) for ev in evs])
        mark = b"" if whole or not rows else bytes(rows[-1][0])
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('prune_after', ?)", (mark,))
    if any(stale.values()):
        with contextlib.suppress(sqlite3.Error):  # busy: another job holds it; later
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute("VACUUM")
    return len(stale["gone"]), len(stale["changed"]), len(rows)
