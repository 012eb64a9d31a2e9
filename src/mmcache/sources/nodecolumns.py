"""A manifest's columns built once per node and memory-mapped by every process that reads it.

Parsing a JSONL manifest costs ~3-4 us and leaves ~400 B of private heap per record in
every rank that reads it (39 GB per rank at 10^8 records), and each process then built
its own table of joined paths for the per-epoch ``stat``. Instead, the first process to
read a manifest writes its :class:`~mmcache.sources.records.Records` (ids, texts, image
references, conversations, the joined and normalised paths, line numbers) to a column
file (:mod:`mmcache.sources.colfile`), and every process, that one included, maps it:
the page cache holds one copy per node, a later start opens it in milliseconds, and the
heap gains nothing per record. Forked workers and the stat prefetcher share the
mapping; a spawned one maps the file again.

**Where**: ``$MMCACHE_COLUMNS_DIR`` (default ``$XDG_CACHE_HOME/mmcache/columns``), a
folder of this user's own (made 0700; a link, another user's folder or one others may
write is not used: the manifest is parsed in memory, with one warning).
``MMCACHE_COLUMNS_DIR=off`` parses in memory every time. One file per manifest *read*:
named by a digest of the manifest's absolute path, the reader, ``on_error``, the folder
its images resolve against and :data:`LAYOUT`, so that a manifest rewritten in place
replaces its file rather than adding one.

**Never stale**: the header records the manifest's identity when it was parsed (device,
inode, size, mtime, ctime, an xxh3-128 digest of its bytes and when they began to be
read). A later open compares the ``fstat`` of the manifest it opened with it; any
difference builds the file again. Equal stat fields are trusted as the identity
ledger trusts them (:data:`~mmcache.sources.identity.RACY_SECONDS`): only if the
manifest's last change was that long before its bytes were read; otherwise the
manifest's bytes are digested again and compared (a rewrite within one tick of a
coarse clock keeps every stat field).

**Built once**: under an ``flock`` on ``<file>.lock``, so of the ranks that start
together one parses and the others wait, then map what it wrote (a builder found stopped,
``SIGSTOP`` or a suspended job, is not waited for: the waiter parses in memory). A damaged file (bad
magic, header digest, truncated, offsets that fall back), a foreign one (another
manifest's header), a link, another user's or a group-writable file is refused and
built again (:class:`~mmcache.sources.colfile.ColumnFileError`, one warning). Any
error writing it (a full disk) costs this process its heap, never a wrong record: the
parsed records are used as they are.

**Swept**: each build removes the column files of manifests deleted or changed since
(:func:`sweep_columns`, at most :data:`SWEEP_BUDGET` files looked at), so a folder does
not fill with the columns of temporary manifests.

Only the built-in readers (``jsonl``, ``llava``) are stored: a registered reader's code
may change between runs without anything here seeing it.

Thread/process safety: no state of its own; the ``flock`` serialises builders between
processes (and threads, each taking its own descriptor).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from typing import Any

import xxhash

from mmcache.rootfiles import UnsafeFileError, make_dir
from mmcache.sources.colfile import ColumnFileError, map_columns, write_columns
from mmcache.sources.identity import RACY_SECONDS
from mmcache.sources.keytable import sweep_tables
from mmcache.sources.records import Records
from mmcache.stores.claims import STOPPED, process_state
from mmcache.stores.memory.shm import lock_holders

__all__ = [
    "LAYOUT",
    "STORED_FORMATS",
    "SWEEP_BUDGET",
    "column_file",
    "columns_dir",
    "load_records",
    "sweep_columns",
]

logger = logging.getLogger(__name__)

#: The layout of what a column file holds: bump it when a reader's output or the columns
#: change, so that files of the old code are never read as this code's.
LAYOUT = 1
#: The readers whose records are stored (a registered one's may change unseen).
STORED_FORMATS = frozenset({"jsonl", "llava"})
_OFF = ("", "off", "none", "0")
_RACY_NS = int(RACY_SECONDS * 1e9)
_CHUNK = 1 << 20


#: Open :func:`memory_only` blocks of this process (a command that must write nothing).
_MEMORY_ONLY = [0]


@contextlib.contextmanager
def memory_only() -> Iterator[None]:
    """Within the block, manifests are parsed in memory: no column file is read, built or
    swept (what ``mmcache inspect`` needs to write nothing). Process-wide while it lasts;
    for commands, not for threads of a training job."""
    _MEMORY_ONLY[0] += 1
    try:
        yield
    finally:
        _MEMORY_ONLY[0] -= 1


def columns_dir() -> str | None:
    """The folder of this user's column files (``$MMCACHE_COLUMNS_DIR``, default
    ``$XDG_CACHE_HOME/mmcache/columns``), or None when it is ``off`` or within
    :func:`memory_only`."""
    if _MEMORY_ONLY[0]:
        return None
    where = os.environ.get("MMCACHE_COLUMNS_DIR")
    if where is not None and where.strip().lower() in _OFF:
        return None
    if not where:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        where = os.path.join(base, "mmcache", "columns")
    return os.path.abspath(where)


def column_file(folder: str, source: str, fmt: str, on_error: str, base_dir: str) -> str:
    """The column file of one manifest read (see the module docstring for its name)."""
    what = [LAYOUT, os.path.abspath(source), fmt, on_error, base_dir]
    name = xxhash.xxh3_128_hexdigest(json.dumps(what, ensure_ascii=True).encode())
    return os.path.join(folder, f"{name}.cols")


def _identity(st: os.stat_result) -> dict[str, int]:
    return {
        "dev": st.st_dev,
        "ino": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }


def _digest(fd: int) -> str:
    """xxh3-128 of the whole file behind ``fd``, read with ``preadv`` (its offset is kept)
    into one buffer (a new bytes object per chunk would leave glibc's heap grown)."""
    hasher = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    pos = 0
    while True:
        got = os.preadv(fd, [buf], pos)
        if not got:
            return hasher.hexdigest()
        hasher.update(view[:got])
        pos += got


def _own_folder(folder: str) -> bool:
    """Make ``folder`` (0700) if absent; whether it is this user's, not a link, and closed
    to others (else one warning: the manifest is parsed in memory)."""
    try:
        make_dir(folder, 0o700)
        st = os.lstat(folder)
    except (OSError, UnsafeFileError) as exc:
        logger.warning("manifest columns: cannot use %s (%s); parsing in memory", folder, exc)
        return False
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
        return True
    logger.warning(
        "manifest columns: %s is not a folder of uid %d closed to others (mode %o, uid %d);"
        " parsing manifests in memory. Set MMCACHE_COLUMNS_DIR to a folder of your own",
        folder,
        os.geteuid(),
        stat.S_IMODE(st.st_mode),
        st.st_uid,
    )
    return False


def _mapped(
    path: str, key: list[Any], fd: int, st: os.stat_result, source: str, *, warn: bool = True
) -> Records | None:
    """The records of ``path`` if it is the column file of this manifest as it is now;
    None if there is none or it is of another version of the manifest (built again).
    ``warn``: log the skipped records, as parsing does."""
    try:
        mapped = map_columns(path)
    except FileNotFoundError:
        return None
    except ColumnFileError as exc:
        logger.warning("manifest columns: %s; building it again", exc)
        return None
    meta = mapped.meta
    if meta.get("key") != key or meta.get("manifest") != _identity(st):
        return None  # another manifest's, or this one before a rewrite
    read_at = meta.get("read_at")
    if not isinstance(read_at, (int, float)):
        return None
    racy = max(st.st_mtime_ns, st.st_ctime_ns) + _RACY_NS > read_at * 1e9
    if racy and meta.get("digest") != _digest(fd):
        return None  # written within a clock tick of being read: the stat fields cannot vouch
    try:
        return Records.from_mapped(mapped, source, warn=warn)
    except ColumnFileError as exc:
        logger.warning("manifest columns: %s; building it again", exc)
        return None


#: A build still holding the lock after this long is looked up (then again each period):
#: a stopped builder is not waited for.
BUILDER_NOTICE_S = 1.0


@contextlib.contextmanager
def _build_lock(path: str) -> Iterator[bool]:
    """An exclusive ``flock`` on ``<path>.lock`` (0600, never through a link), held while
    one process builds; the others wait for it (a holder that dies releases it).

    Yields True once held, or False when the holder is a stopped process (``SIGSTOP``,
    Ctrl-Z, a suspended job: alive, so the kernel keeps its lock, but making no
    progress): the caller then parses the manifest in memory rather than wait for it
    without end (one warning names the pid). A running builder of a large manifest is
    waited for however long it takes. The lock is polled, not waited on, so that a wait
    can look its holder up (``/proc/locks``) every :data:`BUILDER_NOTICE_S`."""
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        look = time.monotonic() + BUILDER_NOTICE_S
        pause = 0.002
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            if time.monotonic() >= look:
                look = time.monotonic() + BUILDER_NOTICE_S
                holders = lock_holders(os.fstat(fd).st_ino)
                stopped = [pid for pid in holders if process_state(pid) in STOPPED]
                if stopped:
                    logger.warning(
                        "manifest columns: pid %s, which builds %s, is stopped (SIGSTOP, "
                        "Ctrl-Z, a suspended job); parsing the manifest in memory here "
                        "instead of waiting (resume or end that process)",
                        ", ".join(map(str, stopped)),
                        path,
                    )
                    yield False
                    return
            time.sleep(pause)
            pause = min(pause * 1.5, 0.05)
        yield True
    finally:
        os.close(fd)


def load_records(
    source: str,
    fd: int,
    st: os.stat_result,
    *,
    fmt: str,
    on_error: str,
    base_dir: str,
    parse: Callable[[], Records],
) -> Records:
    """The records of the manifest ``source`` (opened as ``fd``, whose ``fstat`` is ``st``):
    mapped from this node's column file, which ``parse()`` builds when it is missing,
    stale or refused (see the module docstring). ``parse`` reads ``fd`` from its start."""
    folder = columns_dir()
    if folder is None or fmt not in STORED_FORMATS or not _own_folder(folder):
        return parse()
    path = column_file(folder, source, fmt, on_error, base_dir)
    key = [LAYOUT, os.path.abspath(source), fmt, on_error, base_dir]
    found = _mapped(path, key, fd, st, source)
    if found is not None:
        return found
    try:
        with _build_lock(path) as held:
            if not held:
                return parse()
            found = _mapped(path, key, fd, st, source)  # built while this one waited
            if found is not None:
                return found
            return _build(path, key, fd, st, source, parse=parse)
    except OSError as exc:  # the lock file: a link, a full or read-only disk
        logger.warning("manifest columns: cannot lock %s (%s); parsing in memory", path, exc)
        return parse()


def _build(
    path: str,
    key: list[Any],
    fd: int,
    st: os.stat_result,
    source: str,
    *,
    parse: Callable[[], Records],
) -> Records:
    """Parse the manifest, write its column file and map it (the caller holds the lock);
    the parsed records themselves when the file cannot be written or the manifest
    changed while it was read."""
    read_at = time.time()
    digest = _digest(fd)
    records = parse()
    if _identity(os.fstat(fd)) != _identity(st):
        return records  # changed while read: not stored under its old identity
    meta = {
        **records.column_meta(),
        "key": key,
        "manifest": _identity(st),
        "digest": digest,
        "read_at": read_at,
    }
    try:
        write_columns(path, meta, records.column_arrays())
    except OSError as exc:
        logger.warning("manifest columns: cannot write %s (%s); parsing in memory", path, exc)
        return records
    sweep_columns(os.path.dirname(path), keep=path)
    found = _mapped(path, key, fd, st, source, warn=False)
    if found is None:
        return records
    # The mapped buffers stand in for the parsed ones: drop those, and hand the parse's
    # freed heap back to the system (glibc keeps it otherwise: ~200 B a record of a
    # JSONL's dicts, strings and the id table, in the process that built the file).
    del records
    _trim_heap()
    return found


def _trim_heap() -> None:
    """``malloc_trim(0)`` where the C library has it (glibc); nothing elsewhere."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


#: Most other column files a build looks at for a manifest gone or changed.
SWEEP_BUDGET = 64


def sweep_stale_columns() -> tuple[int, int]:
    """Remove every column file of this user's folder whose manifest is gone or changed,
    then every key table whose column file went or that no process opened for 30 days
    (``mmcache gc``; a build sweeps at most :data:`SWEEP_BUDGET` of each): the numbers of
    column files and of key tables removed. Nothing when the folder is off, absent or not
    this user's own. Process-safe as :func:`sweep_columns` and
    :func:`~mmcache.sources.keytable.sweep_tables`."""
    folder = columns_dir()
    if folder is None or not os.path.isdir(folder) or not _own_folder(folder):
        return 0, 0
    columns = sweep_columns(folder, budget=1 << 62)
    return columns, sweep_tables(folder, budget=1 << 62)


def sweep_columns(folder: str, *, keep: str = "", budget: int = SWEEP_BUDGET) -> int:
    """Remove column files of manifests that are gone or changed since (and their lock
    files), looking at no more than ``budget`` files besides ``keep``, and lock files left
    without a column file: the number of files removed.

    Called after each build, so that a folder does not fill with the columns of deleted
    manifests (temporary ones, a dataset moved) while each build costs a bounded sweep:
    a header read and a ``stat`` per file looked at. A file that cannot be read is left
    (the next build of its name replaces it); a lock another process holds is left with
    its file. A process that has the file mapped keeps its mapping."""
    removed = 0
    try:
        names = {e.name for e in os.scandir(folder)}
    except OSError:
        return 0
    # Lock files left by builds that wrote nothing (a manifest refused under "raise").
    orphans = [n[: -len(".lock")] for n in names if n.endswith(".cols.lock")]
    orphans = [n for n in orphans if n not in names]
    files = [n for n in names if n.endswith(".cols")]
    for name in orphans[:budget]:
        removed += _remove_unlocked(os.path.join(folder, name))
    for path in [os.path.join(folder, n) for n in files if n != os.path.basename(keep)][:budget]:
        try:
            meta = map_columns(path).meta
            source = str(meta["key"][1])
            recorded = meta["manifest"]
        except (OSError, KeyError, IndexError, TypeError):
            continue  # FileNotFoundError, ColumnFileError included: left alone
        try:
            now: dict[str, int] | None = _identity(os.stat(source))
        except OSError:
            now = None  # gone
        if now == recorded:
            continue
        if _remove_unlocked(path):
            removed += 1
    return removed


def _remove_unlocked(path: str) -> bool:
    """Unlink ``path`` and its lock file while holding that lock (not waiting for it)."""
    try:
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + ".lock")
    except OSError:  # held: a build of it is under way
        return False
    finally:
        os.close(fd)
    return True
