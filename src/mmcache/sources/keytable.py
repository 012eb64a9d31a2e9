"""Key tables: each sample's cache key, shared by every process of a node and kept for the next run.

A source's key of sample ``i`` is ``sample_key(id, identity of its files, pipeline
fingerprint, key text)`` (:meth:`~mmcache.sources.chassis.BaseSource.key_rows`), and it
stays right while the sample's stamp row does. Kept per process (the memo it was before),
every DataLoader worker, the stat prefetcher and the training process each held ~49 B per
sample, and each new run hashed every sample again (~28 us each: a ledger look-up and a
digest). A :class:`KeyTable` is one file of fixed-size rows, one per sample index::

    header (4 KiB)   b"MMKEYS\\x00\\x01", uint64 LE length of the JSON that follows,
                     uint64 LE xxh3_64 of it, the JSON {"identity", "n", "k", "watch"}
    row i            key (16 B) | stamp row (k int64) | check (uint64 LE)

and every process that keys maps it ``MAP_SHARED``: the page cache holds one copy per
node, a row one process wrote is found by the others and by later runs, and a process's
own memory gains nothing per sample.

**Identity.** The file is named by, and its header records, a digest of everything a key
depends on besides the stamp (the source names it: its manifest's column file, which
covers the ids, the captions and the paths; the pipeline's fingerprint; the stamp width;
:data:`LAYOUT` and the key format): a caption edited under the same ids and images is
another manifest, so another table. A source that cannot name that cheaply keeps its
private memo.

**Never trusted on its own.** The check word is ``xxh64(index | key | stamp)`` seeded by
the table's identity (:func:`row_checks`: :func:`xxhash.xxh64_intdigest` of each row's
bytes). A row is used only when its check
verifies *and* its stamp equals the sample's stamp taken now: a never-written row (zeros),
a torn one (two processes writing it at once, a reader between a writer's words: an old
key under a new stamp is such a row), a damaged one, or one copied from another table or
index fails the check and the key is computed again. Rows are written (by ``pwrite``:
a full disk is an OSError, never a ``SIGBUS`` through the mapping) only by the source's
own rule for remembering a key (a settled stamp: see ``BaseSource._unsettled``).

**Where.** Beside the manifests' column files (:func:`~mmcache.sources.nodecolumns.columns_dir`,
``$MMCACHE_COLUMNS_DIR``; ``off`` keeps every key table off as well), as
``<identity>.keys``: created sparse (``ftruncate``: 10^8 samples are ~5.6 GB of file but
only rows written take disk and page cache), under a random temp name (``O_EXCL |
O_NOFOLLOW``, 0600) renamed into place while holding ``<name>.lock``. A file there that is
a link, not this user's, open to others, of another size or header is refused and made
again (one warning). Each creation sweeps tables whose column file is gone or was rebuilt,
or, for tar shards, one of whose watched shards is gone or changed (:func:`sweep_tables`).

Thread/process safety: any number of processes and threads read and write one table at
once; what a racing write can leave is a row the check rejects (computed again).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import secrets
import stat
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache.keys import FORMAT_VERSION, stat_stamp
from mmcache.rootfiles import UnsafeFileError, make_dir
from mmcache.sources.colfile import ColumnFileError, map_columns

__all__ = ["LAYOUT", "SWEEP_BUDGET", "KeyTable", "open_table", "row_checks", "sweep_tables"]

logger = logging.getLogger(__name__)

#: The layout of a key table's rows and of what the identity holds: bumped when either
#: changes, so that a table of the old code is never read as this code's.
LAYOUT = 1
MAGIC = b"MMKEYS\x00\x01"
#: Bytes before the first row (the header, padded to a page).
HEADER = 4096
_PREFIX = len(MAGIC) + 16
_SUFFIX = ".keys"
#: Most other tables a creation looks at for one whose column file is gone or rebuilt.
SWEEP_BUDGET = 64
#: A table not opened for this long is swept whatever its column file (a pipeline
#: changed since: its fingerprint names another table), seconds.
UNUSED_SECONDS = 30 * 86400


def row_checks(words: npt.NDArray[np.uint64], seed: int) -> npt.NDArray[np.uint64]:
    """XXH64 of each row of ``words`` (``uint64 [n, m]``, little-endian bytes), ``seed``:
    ``xxhash.xxh64_intdigest(words[i].tobytes(), seed)`` for every row.

    One library call per row (~0.25 us): a guessed batch of 64 rows costs ~16 us, where
    the same hash written as numpy operations over the batch cost ~130 us (a warm epoch
    checks every batch's rows)."""
    data = np.ascontiguousarray(words).tobytes()
    step = words.shape[1] * 8
    digest = xxhash.xxh64_intdigest
    return np.fromiter(
        (digest(data[at : at + step], seed) for at in range(0, len(data), step)),
        dtype=np.uint64,
        count=words.shape[0],
    )


class KeyTable:
    """One mapped key table of ``n`` samples with stamp rows of ``k`` words (see the module
    docstring). Made by :func:`open_table`; pickles as its path and identity (the other
    process maps the file again). Reads are of the shared mapping; writes are ``pwrite``s.
    """

    def __init__(self, path: str, identity: str, n: int, k: int) -> None:
        self.path, self.identity, self.n, self.k = path, identity, n, k
        self._seed = int(identity[:16], 16)
        self._width = 3 + k  # words: key (2), stamp (k), check
        fd = _open_private(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != HEADER + 8 * self._width * n:
                raise _Refused(f"{path} is {os.fstat(fd).st_size} bytes, not a table of {n} rows")
            self._mm = mmap.mmap(fd, HEADER + 8 * self._width * n, prot=mmap.PROT_READ)
            self._fd = fd
        except BaseException:
            os.close(fd)
            raise
        meta = _parse_header(bytes(self._mm[:HEADER]), path)
        if [meta.get("identity"), meta.get("n"), meta.get("k")] != [identity, n, k]:
            self.close()
            raise _Refused(f"{path} is the key table of other samples (its header differs)")
        self._rows: npt.NDArray[np.uint64] = np.frombuffer(
            self._mm, dtype="<u8", count=n * self._width, offset=HEADER
        ).reshape(n, self._width)
        self.writable = True

    def _checks(self, idx: npt.NDArray[np.int64], body: npt.NDArray[np.uint64]) -> Any:
        """The check words of rows ``idx`` holding ``body`` (key and stamp words)."""
        words = np.empty((idx.shape[0], self._width), dtype=np.uint64)
        words[:, 0] = idx.astype(np.uint64)
        words[:, 1:] = body
        return row_checks(words, self._seed)

    def rows(
        self, idx: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """``(keys uint8 [n, 16], stamps int64 [n, k], ok bool [n])`` of samples ``idx``:
        copies of their rows, ``ok`` where the check verifies (a row written whole, of this
        table and index). The caller uses a key only where its stamp is the sample's now."""
        got = self._rows[idx]
        body = got[:, : self._width - 1]
        ok = self._checks(idx, body) == got[:, -1]
        keys = np.ascontiguousarray(body[:, :2]).view(np.uint8)
        stamps = np.ascontiguousarray(body[:, 2:]).view(np.int64)
        return keys, stamps, ok

    def lookup(
        self, idx: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.bool_]]:
        """The keys of ``idx`` and where they may be used: a verified row made under
        ``stamps`` (each sample's stamp row now)."""
        keys, held, ok = self.rows(idx)
        return keys, ok & (held == stamps).all(axis=1)

    def store(
        self, idx: npt.NDArray[np.int64], keys: npt.NDArray[np.uint8], stamps: npt.NDArray[np.int64]
    ) -> None:
        """Write the rows of ``idx`` (their keys ``uint8 [n, 16]``, made under ``stamps``),
        each run of consecutive indices in one ``pwrite``. A write that fails (a full
        disk) leaves the table read-only for this process (one warning): keys are then
        computed, never wrong."""
        if not self.writable or not idx.size:
            return
        body = np.empty((idx.shape[0], self._width - 1), dtype="<u8")
        body[:, :2] = np.ascontiguousarray(keys, dtype=np.uint8).view("<u8").reshape(-1, 2)
        body[:, 2:] = stamps.astype("<i8", copy=False).view("<u8")
        rows = np.empty((idx.shape[0], self._width), dtype="<u8")
        rows[:, :-1] = body
        rows[:, -1] = self._checks(idx, body)
        order = np.argsort(idx, kind="stable")
        idx, rows = idx[order], rows[order]
        breaks = np.flatnonzero(np.diff(idx) != 1) + 1
        row_bytes = 8 * self._width
        try:
            for a, b in zip([0, *breaks.tolist()], [*breaks.tolist(), idx.shape[0]], strict=True):
                os.pwrite(self._fd, rows[a:b].tobytes(), HEADER + row_bytes * int(idx[a]))
        except OSError as exc:
            self.writable = False
            logger.warning("key table %s cannot be written (%s): keys are computed", self.path, exc)

    def fileno(self) -> int:
        """The table's descriptor (read and written by this process)."""
        return self._fd

    def close(self) -> None:
        """Let go of the file (rows read before stay valid copies)."""
        with contextlib.suppress(OSError, ValueError, BufferError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def __reduce__(self) -> tuple[Any, ...]:
        return (KeyTable, (self.path, self.identity, self.n, self.k))


class _Refused(Exception):
    """A table file that is not used (made again)."""


def _open_private(path: str, flags: int) -> int:
    """A descriptor of ``path``, never through a link, only a regular file of this user
    with one link and no group or other access (else :class:`_Refused`)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _Refused(f"{path} cannot be opened: {exc}") from exc
    st = os.fstat(fd)
    problem = (
        "is not a regular file"
        if not stat.S_ISREG(st.st_mode)
        else f"belongs to uid {st.st_uid}"
        if st.st_uid != os.geteuid()
        else f"has {st.st_nlink} links"
        if st.st_nlink != 1
        else f"has mode {stat.S_IMODE(st.st_mode):o}"
        if st.st_mode & 0o077
        else None
    )
    if problem is not None:
        os.close(fd)
        raise _Refused(f"{path} {problem}: not used")
    return fd


def _header_meta(identity: str, n: int, k: int, watch: list[Any] | None) -> dict[str, Any]:
    return {"identity": identity, "n": n, "k": k, "watch": watch}


def _header_bytes(meta: dict[str, Any]) -> bytes:
    text = json.dumps(meta, ensure_ascii=True).encode()
    head = (
        MAGIC
        + len(text).to_bytes(8, "little")
        + xxhash.xxh3_64_intdigest(text).to_bytes(8, "little")
    )
    if len(head) + len(text) > HEADER:
        raise ValueError(f"a key table's header of {len(text)} bytes does not fit {HEADER}")
    return head + text


def _parse_header(head: bytes, path: str) -> dict[str, Any]:
    """The JSON of a table's header (its first :data:`HEADER` bytes), checked."""
    length = int.from_bytes(head[8:16], "little")
    if head[:8] != MAGIC or length > HEADER - _PREFIX:
        raise _Refused(f"{path} is not a key table of this layout")
    text = head[_PREFIX : _PREFIX + length]
    if xxhash.xxh3_64_intdigest(text).to_bytes(8, "little") != head[16:24]:
        raise _Refused(f"{path} has a damaged header")
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise _Refused(f"{path} has a malformed header") from exc
    if not isinstance(meta, dict):
        raise _Refused(f"{path} has a malformed header")
    return meta


def table_identity(parts: list[Any]) -> str:
    """The identity (32 hex digits) of a table from what its keys depend on besides the
    stamps (JSON-able ``parts``; :data:`LAYOUT` and the key format are added)."""
    text = json.dumps([LAYOUT, FORMAT_VERSION, *parts], ensure_ascii=True, sort_keys=True)
    return xxhash.xxh3_128_hexdigest(text.encode())


def open_table(
    folder: str, identity: str, n: int, k: int, *, watch: list[Any] | None = None
) -> KeyTable | None:
    """The key table ``identity`` (see :func:`table_identity`) of ``n`` samples with stamp
    rows of ``k`` words in ``folder``, made (sparse, empty) when missing or refused; None
    when none can be used (the folder is not this user's private one, a full or read-only
    disk: one warning; the caller keeps its keys to itself). ``watch``: ``[path, digest]``
    of the column file the identity was made from: the table is swept when that file is
    gone or holds another digest (:func:`sweep_tables`)."""
    if not _own_folder(folder):
        return None
    path = os.path.join(folder, identity + _SUFFIX)
    try:
        found = KeyTable(path, identity, n, k)
    except FileNotFoundError:
        pass
    except _Refused as exc:
        logger.warning("key table %s; making it again", exc)
    else:
        with contextlib.suppress(OSError):
            os.utime(found.fileno())  # opened now: not swept as unused (UNUSED_SECONDS)
        return found
    try:
        with _lock(path):
            with contextlib.suppress(FileNotFoundError, _Refused):
                return KeyTable(path, identity, n, k)  # made while this one waited
            _create(path, _header_bytes(_header_meta(identity, n, k, watch)), n, k)
            table = KeyTable(path, identity, n, k)
    except (OSError, _Refused) as exc:
        logger.warning("key table %s cannot be made (%s): keys stay in this process", path, exc)
        return None
    sweep_tables(folder, keep=path)
    return table


def _own_folder(folder: str) -> bool:
    try:
        make_dir(folder, 0o700)
        st = os.lstat(folder)
    except (OSError, UnsafeFileError):
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _create(path: str, header: bytes, n: int, k: int) -> None:
    """Write an empty table (``header``, then ``n`` rows of zeros, a hole) to ``path`` by a
    private temp file renamed over it (replacing a refused file or link, never writing
    through one)."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            os.pwrite(fd, header.ljust(HEADER, b"\x00"), 0)
            os.ftruncate(fd, HEADER + 8 * (3 + k) * n)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _lock(path: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``<path>.lock`` (0600, never through a link)."""
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def sweep_tables(folder: str, *, keep: str = "", budget: int = SWEEP_BUDGET) -> int:
    """Remove key tables (and their lock files) whose watched column file is gone or holds
    another digest (its manifest changed: the table's keys are of samples that are no
    more), or that no process opened for :data:`UNUSED_SECONDS` (another pipeline's),
    looking at no more than ``budget`` tables besides ``keep``: how many. A table being
    made (its lock held) or unreadable is left; a process that maps one keeps it."""
    try:
        names = [e.name for e in os.scandir(folder) if e.name.endswith(_SUFFIX)]
    except OSError:
        return 0
    removed = 0
    for name in [n for n in names if n != os.path.basename(keep)][:budget]:
        path = os.path.join(folder, name)
        try:
            fd = _open_private(path, os.O_RDONLY)
        except (OSError, _Refused):
            continue
        try:
            unused = os.fstat(fd).st_mtime < time.time() - UNUSED_SECONDS
            watch = _parse_header(os.pread(fd, HEADER, 0), path).get("watch")
        except _Refused:
            continue
        finally:
            os.close(fd)
        if not unused and (not isinstance(watch, list) or len(watch) != 2 or _watched(watch)):
            continue
        removed += _remove_unlocked(path)
    return removed


def _watched(watch: list[Any]) -> bool:
    """Whether the column file ``watch[0]`` is there with header digest ``watch[1]``, or,
    for ``["stat", [[path, stamp], ...]]`` (a source of files without a column file: tar
    shards), whether each file is there with that :func:`~mmcache.keys.stat_stamp`."""
    if watch[0] == "stat":
        files = watch[1] if isinstance(watch[1], list) else []
        return all(_same_file(w) for w in files if isinstance(w, list) and len(w) == 2)
    try:
        return bool(map_columns(str(watch[0])).digest == watch[1])
    except FileNotFoundError:
        return False
    except (OSError, ColumnFileError):
        return True  # unreadable now: left alone


def _same_file(watch: list[Any]) -> bool:
    """Whether the file ``watch[0]`` is there with ``stat`` stamp ``watch[1]``."""
    try:
        return bool(stat_stamp(os.stat(str(watch[0]))) == watch[1])
    except FileNotFoundError:
        return False
    except OSError:
        return True  # unreadable now: left alone


def _remove_unlocked(path: str) -> int:
    """Unlink ``path`` and its lock file holding that lock (not waiting): 1 if removed."""
    try:
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return 0
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for name in (path, path + ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
    except OSError:
        return 0
    finally:
        os.close(fd)
    return 1
