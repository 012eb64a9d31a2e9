"""The member index file of one shard version: its samples' table
(:class:`~mmcache.sources.wds.table.ShardTable`) as fixed-dtype arrays behind a small
header, read back with one ``read`` and a few array checks.

Why binary arrays: the JSON index it replaces was parsed and regrouped, member by
member, in every process of every run (31 us a sample on each later start: 52 minutes
at 10^8 samples, in each rank); this file is read, checked and copied into the source's
one table at C speed (well under 2 us a sample). Never unpickled; every size is checked
against the file's before anything is read.

Layout (little-endian)::

    magic "MMCWDSI\\0" | u32 version | u32 meta bytes | u64 samples n | u64 key bytes
    meta: UTF-8 JSON {format, location, stamp, size, truncated, members, exts, repeated}
    zeros to a multiple of 8
    rows    int64 [n, 10]   (ShardTable.rows)
    id_off  int64 [n + 1]   (where each key starts in id_buf)
    id_buf  uint8 [key bytes]

Why read, not memory-mapped: the arrays are copied into the source's table of all
shards at once anyway (a shard's table is ~1 MB for 10k samples), and a mapping of a
file that another process truncates kills the reader with SIGBUS, which a read cannot.

A file that is not one (wrong magic, sizes that do not add up to its length, a table
that does not fit its shard: offsets past the shard's end, extension numbers outside
the lists, keys that are not UTF-8) is refused with a warning naming the file, and the
shard is indexed again; a file of another version or of another shard version (the
name is a digest of both) is replaced quietly.

Thread/process safety: a file is written to a temporary name and renamed, so readers
see a whole file or none, and concurrent writers of one shard each write a whole one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import tempfile
from typing import Any, TypeGuard

import numpy as np
import numpy.typing as npt

from mmcache.sources.wds.table import Exts, ShardTable

__all__ = ["FORMAT", "SUFFIX", "VERSION", "location_of", "read", "write"]

logger = logging.getLogger(__name__)

#: Bump when the file's meaning changes: older files are indexed again.
VERSION = 2
FORMAT = "mmcache.wds-table"
SUFFIX = ".wdsi"
_MAGIC = b"MMCWDSI\0"
_HEAD = struct.Struct("<8sIIQQ")
_COLUMNS = ShardTable.COLUMNS


class _Refused(Exception):
    """A file that is not a valid member index file: why."""


class _Stale(_Refused):
    """A member index file of another version: replaced without a warning."""


def write(path: str, table: ShardTable) -> None:
    """Keep ``table`` at ``path`` (a temporary file renamed into place). Raises OSError."""
    meta = json.dumps(
        {
            "format": FORMAT,
            "location": table.location,
            "stamp": table.stamp,
            "size": table.size,
            "truncated": table.truncated,
            "members": table.members,
            "exts": [list(e) for e in table.exts],
            "repeated": [list(r) for r in table.repeated],
        },
        separators=(",", ":"),
    ).encode("utf-8", "surrogatepass")
    n, key_bytes = len(table), int(table.id_buf.shape[0])
    head = _HEAD.pack(_MAGIC, VERSION, len(meta), n, key_bytes)
    pad = b"\0" * (-(len(head) + len(meta)) % 8)
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=SUFFIX)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(head + meta + pad)
            out.write(np.ascontiguousarray(table.rows, dtype="<i8").data)
            out.write(np.ascontiguousarray(table.id_off, dtype="<i8").data)
            out.write(np.ascontiguousarray(table.id_buf, dtype=np.uint8).data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read(path: str, *, location: str, stamp: str, exts: Exts) -> ShardTable | None:
    """The table kept at ``path`` if it is a valid one of this shard version and these
    extensions, else ``None`` (a warning naming the file when it is damaged)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(os.fstat(fh.fileno()).st_size)  # bounded by the file's size
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("cannot read the member index %s (%s): indexing the shard again", path, exc)
        return None
    try:
        return _parse(data, location=location, stamp=stamp, exts=exts)
    except _Stale:
        return None
    except _Refused as exc:
        logger.warning("member index %s refused: %s; indexing the shard again", path, exc)
        return None


def location_of(path: str) -> str | None:
    """The shard location a member index file names (None: not one of this version).
    Reads the header and the meta only. Raises OSError."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        head = fh.read(_HEAD.size)
        try:
            meta_len = _header(head, size)[1]
            meta = _meta(fh.read(meta_len))
        except _Refused:
            return None
    location = meta.get("location")
    return location if isinstance(location, str) else None


def _header(head: bytes, size: int) -> tuple[int, int, int, int]:
    """``(version, meta bytes, n, key bytes)`` of a file of ``size`` bytes, checked."""
    if len(head) < _HEAD.size:
        raise _Refused(f"{size} bytes, shorter than its header")
    magic, version, meta_len, n, key_bytes = _HEAD.unpack_from(head)
    if magic != _MAGIC:
        raise _Refused("not a member index file (its first bytes are not the format's)")
    if version != VERSION:
        raise _Stale(f"version {version}, not {VERSION}")
    start = _HEAD.size + meta_len + (-(_HEAD.size + meta_len) % 8)
    expected = start + 8 * _COLUMNS * n + 8 * (n + 1) + key_bytes
    if expected != size:  # Python ints: no overflow, whatever the header says
        raise _Refused(
            f"its header says {n} samples and {key_bytes} key bytes ({expected} bytes in "
            f"all), but the file has {size}"
        )
    return version, meta_len, n, key_bytes


def _meta(raw: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _Refused(f"its meta is not JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _Refused("its meta is not a member index's")
    return meta


def _parse(data: bytes, *, location: str, stamp: str, exts: Exts) -> ShardTable | None:
    _, meta_len, n, key_bytes = _header(data, len(data))
    meta = _meta(data[_HEAD.size : _HEAD.size + meta_len])
    if (meta.get("location"), meta.get("stamp")) != (location, stamp):
        return None  # another shard version under this name: a digest collision
    if meta.get("exts") != [list(e) for e in exts]:
        return None
    size, members, truncated = meta.get("size"), meta.get("members"), meta.get("truncated")
    repeated = meta.get("repeated")
    if not (_is_int(size) and _is_int(members) and isinstance(truncated, bool)):
        raise _Refused("its meta lacks the shard's size, member count or truncation")
    if not isinstance(repeated, list) or not all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(v, str) for v in r) for r in repeated
    ):
        raise _Refused("its list of repeated members is not pairs of strings")
    start = _HEAD.size + meta_len + (-(_HEAD.size + meta_len) % 8)
    rows = np.frombuffer(data, dtype="<i8", count=n * _COLUMNS, offset=start)
    rows = rows.reshape(n, _COLUMNS).astype(np.int64)
    start += 8 * _COLUMNS * n
    id_off = np.frombuffer(data, dtype="<i8", count=n + 1, offset=start).astype(np.int64)
    id_buf = np.frombuffer(data, dtype=np.uint8, count=key_bytes, offset=start + 8 * (n + 1))
    _check_keys(id_buf, id_off)
    _check_rows(rows, size, exts)
    return ShardTable(
        location=location,
        stamp=stamp,
        size=size,
        truncated=truncated,
        members=members,
        exts=exts,
        rows=rows,
        id_buf=id_buf.copy(),
        id_off=id_off,
        repeated=tuple((r[0], r[1]) for r in repeated),
    )


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_keys(id_buf: npt.NDArray[np.uint8], id_off: npt.NDArray[np.int64]) -> None:
    """Every key non-empty, inside the buffer, and valid UTF-8 on its own."""
    if id_off[0] != 0 or id_off[-1] != id_buf.shape[0] or np.any(np.diff(id_off) < 1):
        raise _Refused("its key offsets are not increasing from 0 to the key bytes")
    # The whole buffer decodes and no key starts inside a character: each key decodes.
    try:
        id_buf.tobytes().decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise _Refused(f"its keys are not UTF-8 ({exc})") from None
    starts = id_buf[id_off[:-1]]
    if np.any((starts >= 0x80) & (starts < 0xC0)):
        raise _Refused("a key starts inside a UTF-8 character")


def _check_rows(rows: npt.NDArray[np.int64], size: int, exts: Exts) -> None:
    """Every member span inside the shard, every extension number inside its list,
    every sample's first member one it has."""
    for off_col, len_col, what in ((0, 1, "image"), (2, 3, "text")):
        off, length = rows[:, off_col], rows[:, len_col]
        absent = (off == -1) & (length == -1)
        inside = (off >= 0) & (off <= size) & (length >= 0) & (length <= size - off)
        if not np.all(absent | inside):
            i = int(np.flatnonzero(~(absent | inside))[0])
            raise _Refused(
                f"sample {i}'s {what} member ({int(off[i])}, {int(length[i])} bytes) is not "
                f"inside the {size}-byte shard"
            )
    image, text = rows[:, 0] >= 0, rows[:, 2] >= 0
    checks = (
        (4, image, len(exts[0]), "image"),
        (7, text, len(exts[1]), "text"),
    )
    for col, present, count, what in checks:
        number = rows[:, col]
        good = np.where(present, (number >= 0) & (number < count), number == -1)
        if not np.all(good):
            raise _Refused(f"a {what} extension number is outside the {count} listed")
    json_number, role = rows[:, ShardTable.JSON_EXT], rows[:, ShardTable.FIRST_ROLE]
    if not np.all((json_number >= -1) & (json_number < len(exts[2]))):
        raise _Refused(f"a json extension number is outside the {len(exts[2])} listed")
    has = np.select([role == 0, role == 1, role == 2], [image, text, json_number >= 0], False)
    if not np.all(has):
        raise _Refused("a sample's first member is one it does not have")
