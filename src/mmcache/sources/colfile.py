"""Flat column files: named fixed-dtype numpy arrays in one file, memory-mapped read-only.

The on-disk form of a manifest's columns (:mod:`mmcache.sources.nodecolumns` decides
where they live and when they are built). A file holds a checked header and the arrays,
each at a 64-byte aligned offset::

    b"MMCOLS\\x00\\x01"  magic and layout (8 bytes)
    uint64 LE           length of the header (JSON, UTF-8)
    uint64 LE           xxh3_64 of the header bytes
    header              {"meta": {...}, "arrays": [[name, dtype, offset, count], ...]}
    arrays              each at its offset, little-endian

Why this form: every rank, worker and prefetcher maps the same file, so the page cache
holds one copy per node and a process's heap gains nothing per row (a parsed manifest
was ~400 B of private heap per row in every rank). Nothing in it is unpickled: the
header is JSON whose digest is checked before it is parsed, the arrays are raw numbers
of dtypes named in an allow-list, and :func:`map_columns` checks that every array lies
inside the file. What the numbers *mean* (offsets that rise, a row count) the caller
checks (:func:`check_offsets`).

A file is written whole under a random temp name (``O_EXCL | O_NOFOLLOW``, mode 0600)
and renamed into place (:func:`write_columns`), so a reader sees the old file or the new
one, never a part; it is opened with ``O_NOFOLLOW`` and refused unless it is a regular
file of this user with one link and no group or other access (:func:`map_columns`).

Thread/process safety: no shared state; a :class:`Mapped` is read-only, and so are the
arrays it gives (any number of threads and forked processes read them at once).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import secrets
import stat
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache.errors import CacheError

__all__ = ["ColumnFileError", "Mapped", "check_offsets", "map_columns", "write_columns"]

MAGIC = b"MMCOLS\x00\x01"
_ALIGN = 64
#: The dtypes a column file may hold (nothing else is ever made from its bytes).
_DTYPES = frozenset({"|u1", "|b1", "<i8", "<u8"})
#: Most bytes of a header (its rejects are the only part that grows with the data).
_MAX_HEADER = 1 << 30
_PREFIX = len(MAGIC) + 16


class ColumnFileError(CacheError):
    """A column file is damaged, foreign, a link or not this user's: it is not used (its
    caller builds it again)."""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def write_columns(
    path: str, meta: Mapping[str, Any], arrays: Mapping[str, npt.NDArray[Any]]
) -> None:
    """Write ``meta`` (JSON-able) and ``arrays`` to ``path`` atomically, mode 0600.

    The file is written under a random name beside ``path`` (created exclusively, never
    through a link) and renamed over ``path``, which replaces a link or a damaged file
    there rather than writing through it. Raises OSError (a full or read-only file
    system), leaving nothing behind."""
    table: list[list[Any]] = []
    parts: list[npt.NDArray[Any]] = []
    for name, array in arrays.items():
        a = np.ascontiguousarray(array)
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        if a.dtype.str not in _DTYPES:
            raise ValueError(f"column {name!r} has dtype {a.dtype.str}, not one of {_DTYPES}")
        table.append([name, a.dtype.str, 0, int(a.size)])
        parts.append(a.reshape(-1))
    # Offsets depend on the header's length, which holds them: lay out with a header
    # width that is rounded up, then fix the offsets (the header only shrinks or stays).
    header = b""
    while True:
        start = _aligned(_PREFIX + len(header) + 64)
        pos = start
        for row, a in zip(table, parts, strict=True):
            row[2] = pos
            pos = _aligned(pos + a.nbytes)
        header = json.dumps({"meta": dict(meta), "arrays": table}, ensure_ascii=True).encode()
        if _PREFIX + len(header) <= start:
            break
    prefix = (
        MAGIC
        + len(header).to_bytes(8, "little")
        + xxhash.xxh3_64_intdigest(header).to_bytes(8, "little")
    )
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            _write_all(fd, prefix + header)
            for row, a in zip(table, parts, strict=True):
                os.lseek(fd, int(row[2]), os.SEEK_SET)
                _write_all(fd, a.view(np.uint8).data)
            os.ftruncate(fd, _aligned(os.lseek(fd, 0, os.SEEK_CUR)))
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Mapped:
    """An open column file: :attr:`meta` (the header's JSON object) and :meth:`array`.

    The mapping lives as long as this object or any array made from it. Pickles as its
    path and header digest: the other process maps the file again, and refuses it
    (:class:`ColumnFileError`) if another file took the name since.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        fd = _open_own(path)
        try:
            size = os.fstat(fd).st_size
            if size < _PREFIX:
                raise ColumnFileError(f"column file {path} is truncated ({size} bytes)")
            self._mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        mm = self._mm
        if mm[: len(MAGIC)] != MAGIC:
            raise ColumnFileError(f"column file {path} is not one of this layout (bad magic)")
        length = int.from_bytes(mm[8:16], "little")
        digest = int.from_bytes(mm[16:24], "little")
        if length > min(_MAX_HEADER, size - _PREFIX):
            raise ColumnFileError(f"column file {path} is truncated (header of {length} bytes)")
        header = mm[_PREFIX : _PREFIX + length]
        if xxhash.xxh3_64_intdigest(header) != digest:
            raise ColumnFileError(f"column file {path} has a damaged header (digest differs)")
        self.digest = digest
        try:
            parsed = json.loads(header)
            self.meta: dict[str, Any] = dict(parsed["meta"])
            table = [(str(n), str(d), int(o), int(c)) for n, d, o, c in parsed["arrays"]]
        except (ValueError, TypeError, KeyError) as exc:
            raise ColumnFileError(f"column file {path} has a malformed header: {exc}") from exc
        self._arrays: dict[str, tuple[str, int, int]] = {}
        for name, dtype, offset, count in table:
            width = np.dtype(dtype).itemsize if dtype in _DTYPES else 0
            if not width or offset < _PREFIX + length or count < 0:
                raise ColumnFileError(f"column file {path}: column {name!r} is malformed")
            if offset + count * width > size:
                raise ColumnFileError(f"column file {path} is truncated (column {name!r})")
            self._arrays[name] = (dtype, offset, count)

    def names(self) -> list[str]:
        """The columns the file holds."""
        return list(self._arrays)

    def array(self, name: str, dtype: str) -> npt.NDArray[Any]:
        """Column ``name`` as a read-only array of ``dtype`` (``"<i8"``...) over the mapping;
        ColumnFileError if the file has no such column of that dtype."""
        got = self._arrays.get(name)
        if got is None or got[0] != dtype:
            raise ColumnFileError(f"column file {self.path} has no {dtype} column {name!r}")
        _, offset, count = got
        out: npt.NDArray[Any] = np.frombuffer(self._mm, dtype=dtype, count=count, offset=offset)
        return out

    def offsets(self, name: str, rows: int, data: int) -> npt.NDArray[np.int64]:
        """The ``int64`` offsets column ``name``, checked to be ``rows + 1`` rising numbers
        from 0 to ``data`` (the bytes of its string column): what keeps a damaged file
        from slicing outside its buffer (ColumnFileError otherwise). The check reads every
        page of the column through the mapping; they are then let go of (``MADV_DONTNEED``:
        they stay in the page cache), so that this process holds only the pages it reads
        later, not every offset of every column as memory of its own."""
        off = self.array(name, "<i8")
        check_offsets(off, rows, data, name)
        _, offset, count = self._arrays[name]
        page = mmap.PAGESIZE
        start = offset // page * page
        with contextlib.suppress(OSError, ValueError):  # advice only
            self._mm.madvise(mmap.MADV_DONTNEED, start, offset + 8 * count - start)
        return off

    def __reduce__(self) -> tuple[Any, ...]:
        return (_remap, (self.path, self.digest))


def _remap(path: str, digest: int) -> Mapped:
    got = Mapped(path)
    if got.digest != digest:
        raise ColumnFileError(
            f"column file {path} was replaced since this process's parent mapped it (its"
            " manifest was rewritten): start the job again to read the new manifest"
        )
    return got


def _open_own(path: str) -> int:
    """A read-only descriptor of ``path``: never through a link, and only a regular file of
    this user with one link and no group or other access (else ColumnFileError)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ColumnFileError(f"column file {path} cannot be opened: {exc}") from exc
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to uid {st.st_uid}, not this user's {os.geteuid()}"
    elif st.st_nlink != 1:
        problem = f"has {st.st_nlink} links (a hard link)"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):o} (others may write it)"
    if problem:
        os.close(fd)
        raise ColumnFileError(f"column file {path} {problem}: not used")
    return fd


def map_columns(path: str) -> Mapped:
    """Map the column file ``path``: FileNotFoundError when there is none,
    :class:`ColumnFileError` when it is damaged, a link, or not this user's private file."""
    return Mapped(path)


def check_offsets(offsets: npt.NDArray[np.int64], rows: int, data: int, what: str) -> None:
    """ColumnFileError unless ``offsets`` are ``rows + 1`` rising numbers from 0 to ``data``
    (a string column's ends): what keeps a damaged file from slicing outside its buffer.
    Checked in chunks, so the scratch stays small."""
    if offsets.shape[0] != rows + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != data:
        raise ColumnFileError(f"the {what} column's offsets do not fit its {data} bytes")
    step = 1 << 20
    for a in range(0, rows, step):
        chunk = offsets[a : a + step + 1]
        if bool((chunk[1:] < chunk[:-1]).any()):
            raise ColumnFileError(f"the {what} column's offsets fall back (a damaged file)")
