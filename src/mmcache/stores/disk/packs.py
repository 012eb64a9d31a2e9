"""Packs: the small entries of a write transaction stored together in one LMDB value.

Why
    LMDB keeps a value of up to ~2 KB inside a 4 KiB B-tree leaf page, at
    most three ~1 KB values a page (a full page is already 1.33x their
    size), and inserts in random key order split leaves to 50-70% fill: the
    disk tier held ~1 KB entries at 2.1x their size. A larger value goes to
    overflow pages, whole pages each (a 4 KiB entry takes two: 2.0x). A value
    of many entries in a row is stored in contiguous overflow pages at ~1.0x,
    whatever the order of the keys.

Layout (three named databases beside ``data``, ``meta`` and ``info``)
    ``packs``: pack id (8 bytes, big-endian, increasing: appended at the end
    of the B-tree) -> the pack: its entries, each at a 16-byte aligned offset
    (as a large value in its overflow pages), then a directory of ``(key,
    offset)`` for every entry it was written with and the entry count.
    ``slots``: entry key -> ``(pack id, offset, length)`` (:data:`SLOT`).
    ``packlive``: pack id -> ``(live entries, live bytes, pack length)``.
    An entry is in exactly one of ``data`` (stored alone, as before: large
    entries, and small ones written without enough company) and ``slots``.

Writes
    A write transaction collects its small entries (at most
    :data:`PACK_MAX_ENTRY` bytes) in a :class:`Packer` and writes them when it
    commits: into packs of about :data:`PACK_BYTES` when they add up to at
    least :data:`PACK_MIN_BYTES`, else alone into ``data``. The meta record,
    the totals and the budget are the entry's, as for any entry: the budget
    counts payload bytes. Atomic and crash-safe as every LMDB transaction: the
    pack, its slots and the meta records commit together or not at all.

Deletes and the space of dead entries
    Deleting a packed entry removes its slot and lowers its pack's live
    counts; the bytes stay in the pack. A pack with no live entry is deleted;
    one whose live bytes fall below :data:`REWRITE_BELOW` of its length has
    its live entries moved into the transaction's :class:`Packer` (written
    again, into new packs) and is deleted. So every pack is at least half
    live: the dead bytes never exceed the live ones, inside the ``2 x
    capacity`` the map size allows (rewriting at half keeps the write
    amplification of eviction at about one extra write of each byte evicted).

Reads
    :func:`read_value` finds an entry in ``data`` or through its slot, as a
    slice of its pack: zero-copy in a transaction with ``buffers=True``
    (py-lmdb touches every page of a value it returns: a pack costs a touch of
    its ~16 pages, hence packs of 64 KiB, not megabytes). A slot that points
    outside its pack reads as absent; ``verify`` reports it.

Thread/process safety: functions of a transaction the caller holds; a
:class:`Packer` belongs to one write transaction.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any, Protocol

import lmdb

from mmcache.units import KiB

__all__ = [
    "PACK_BYTES",
    "PACK_MAX_ENTRY",
    "PACK_MIN_BYTES",
    "REWRITE_BELOW",
    "SLOT",
    "PackDbs",
    "Packer",
    "pack_entries",
    "read_packed",
    "read_slot",
    "read_value",
    "recount_packs",
]

#: Entries of at most this many bytes are packed (above it, overflow pages waste <= 25%).
PACK_MAX_ENTRY = 16 * KiB
#: A pack closes once it holds this many bytes (a read touches all of its pages).
PACK_BYTES = 64 * KiB
#: Fewer small bytes than this in a transaction are stored alone (a pack's last page
#: would waste more than storing them alone does).
PACK_MIN_BYTES = 8 * KiB
#: A pack whose live bytes fall below this fraction of its length is rewritten.
REWRITE_BELOW = 0.5

#: ``slots`` record: pack id, offset, length.
SLOT = struct.Struct("<QII")
#: ``packlive`` record: live entries, live bytes, pack length.
_LIVE = struct.Struct("<qqq")
_DIR_ENTRY = struct.Struct("<16sI")  # key, offset: the pack's directory
_DIR_COUNT = struct.Struct("<I")
_ALIGN = 16
_ID = struct.Struct(">Q")
_NEXT_KEY = b"nextpack"  # in the info db: the next pack id


class PackDbs(Protocol):
    """The databases packs live in (an :class:`~.env.EnvHandle`, or a salvage target's)."""

    data: Any
    info: Any
    slots: Any
    packs: Any
    packlive: Any


def read_slot(raw: bytes | memoryview | None) -> tuple[int, int, int] | None:
    """``(pack id, offset, length)`` of a slot record; None if absent or not one."""
    if raw is None or len(raw) != SLOT.size:
        return None
    pack, offset, length = SLOT.unpack(raw)
    return int(pack), int(offset), int(length)


def read_value(
    txn: lmdb.Transaction[Any],
    h: PackDbs,
    key: bytes,
    seen: dict[int, Any] | None = None,
) -> Any:
    """The stored bytes of ``key`` (from ``data``, or a slice of its pack), or None.

    In a ``buffers=True`` transaction a zero-copy buffer valid inside it; in
    another, bytes (a pack is then copied whole: reads use buffers). ``seen``
    keeps the packs this call's caller has fetched (a gather reads many
    entries of few packs). A slot outside its pack reads as None.
    """
    value = txn.get(key, db=h.data)
    return value if value is not None else read_packed(txn, h, key, seen)


def read_packed(
    txn: lmdb.Transaction[Any],
    h: PackDbs,
    key: bytes,
    seen: dict[int, Any] | None = None,
) -> Any:
    """:func:`read_value` of an entry not in ``data``: the slice of its pack, or None.

    For the gathers' loops, which look in ``data`` themselves: one Python call
    for a packed entry, none for one stored alone.
    """
    slot = txn.get(key, db=h.slots)
    if slot is None or len(slot) != SLOT.size:
        return None
    pack_id, offset, length = SLOT.unpack(slot)
    pack = seen.get(pack_id) if seen is not None else None
    if pack is None:
        pack = txn.get(_ID.pack(pack_id), db=h.packs)
        if pack is None:
            return None
        if seen is not None:
            seen[pack_id] = pack
    if offset + length > len(pack):
        return None
    if isinstance(pack, memoryview):
        return pack[offset : offset + length]
    return bytes(pack[offset : offset + length])


def _directory(pack: bytes | memoryview) -> Iterator[tuple[bytes, int]]:
    """``(key, offset)`` of every entry the pack was written with (none if damaged)."""
    if len(pack) < _DIR_COUNT.size:
        return
    (count,) = _DIR_COUNT.unpack_from(pack, len(pack) - _DIR_COUNT.size)
    start = len(pack) - _DIR_COUNT.size - count * _DIR_ENTRY.size
    if start < 0:
        return
    for i in range(count):
        key, offset = _DIR_ENTRY.unpack_from(pack, start + i * _DIR_ENTRY.size)
        yield bytes(key), int(offset)


def pack_entries(items: list[tuple[bytes, Any]]) -> tuple[bytes, list[int]]:
    """The pack of ``items`` (key, bytes-like) and each entry's offset in it."""
    parts: list[Any] = []
    offsets: list[int] = []
    pos = 0
    for _key, buf in items:
        pad = -pos % _ALIGN
        if pad:
            parts.append(bytes(pad))
            pos += pad
        offsets.append(pos)
        parts.append(buf)
        pos += len(buf)
    parts.extend(_DIR_ENTRY.pack(k, o) for (k, _), o in zip(items, offsets, strict=True))
    parts.append(_DIR_COUNT.pack(len(items)))
    return b"".join(parts), offsets


class Packer:
    """The small entries one write transaction packs when it ends (see the module).

    ``add`` an entry instead of putting it into ``data``; ``remove`` any entry
    (pending here, alone in ``data``, or packed); ``flush`` before the commit.
    Not thread-safe: it belongs to one write transaction.
    """

    def __init__(self, txn: lmdb.Transaction[Any], h: PackDbs) -> None:
        self._txn = txn
        self._h = h
        self._pending: dict[bytes, Any] = {}
        self._bytes = 0

    @property
    def pending_bytes(self) -> int:
        """Bytes of the entries waiting for :meth:`flush` (in no page yet)."""
        return self._bytes

    def add(self, key: bytes, buf: Any) -> None:
        """Write ``buf`` under ``key`` at :meth:`flush` (the caller removed any old value)."""
        self._pending[key] = buf
        self._bytes += len(buf)

    def remove(self, key: bytes) -> bool:
        """Remove the value of ``key`` wherever it is; whether there was one."""
        buf = self._pending.pop(key, None)
        if buf is not None:
            self._bytes -= len(buf)
            return True
        txn, h = self._txn, self._h
        if txn.delete(key, db=h.data):
            return True
        slot = read_slot(txn.pop(key, db=h.slots))
        if slot is None:
            return False
        self._release(*slot)
        return True

    def _release(self, pack_id: int, offset: int, length: int) -> None:
        """One entry of the pack fewer: delete it when empty, rewrite it when mostly dead."""
        txn, h = self._txn, self._h
        pid = _ID.pack(pack_id)
        raw = txn.get(pid, db=h.packlive)
        if raw is None or len(raw) != _LIVE.size:
            return  # a damaged count: rebuild_totals recounts it
        items, live, size = _LIVE.unpack(raw)
        items, live = items - 1, live - length
        if items <= 0:
            txn.delete(pid, db=h.packs)
            txn.delete(pid, db=h.packlive)
        elif live < REWRITE_BELOW * size:
            self._rewrite(pack_id, pid)
        else:
            txn.put(pid, _LIVE.pack(items, live, size), db=h.packlive)

    def _rewrite(self, pack_id: int, pid: bytes) -> None:
        """Move the live entries of a pack into this transaction's packs; delete it."""
        txn, h = self._txn, self._h
        pack = txn.get(pid, db=h.packs)
        if pack is not None:
            for key, offset in _directory(pack):
                slot = read_slot(txn.get(key, db=h.slots))
                if slot is None or slot[0] != pack_id or slot[1] != offset:
                    continue  # deleted, or packed again elsewhere since
                end = offset + slot[2]
                if end <= len(pack):  # a slot outside its pack: verify reports it
                    txn.delete(key, db=h.slots)
                    self.add(key, bytes(pack[offset:end]))
        txn.delete(pid, db=h.packs)
        txn.delete(pid, db=h.packlive)

    def flush(self) -> None:
        """Write the pending entries: packs, or alone when too few bytes."""
        pending, self._pending, self._bytes = list(self._pending.items()), {}, 0
        if not pending:
            return
        txn, h = self._txn, self._h
        if len(pending) < 2 or sum(len(b) for _, b in pending) < PACK_MIN_BYTES:
            for key, buf in pending:
                txn.put(key, buf, db=h.data)
            return
        next_id = _next_id(txn, h)
        start = 0
        while start < len(pending):
            stop, size = start + 1, len(pending[start][1])
            while stop < len(pending) and size + len(pending[stop][1]) <= PACK_BYTES:
                size += len(pending[stop][1])
                stop += 1
            group = pending[start:stop]
            pack, offsets = pack_entries(group)
            pid = _ID.pack(next_id)
            txn.put(pid, pack, db=h.packs, append=True)
            txn.put(pid, _LIVE.pack(len(group), size, len(pack)), db=h.packlive, append=True)
            for (key, buf), offset in zip(group, offsets, strict=True):
                txn.put(key, SLOT.pack(next_id, offset, len(buf)), db=h.slots)
            next_id += 1
            start = stop
        txn.put(_NEXT_KEY, _ID.pack(next_id), db=h.info)


def _next_id(txn: lmdb.Transaction[Any], h: PackDbs) -> int:
    """The next pack id: never one used before (a stale slot could name it), even if
    the record of it is lost (then past the highest id still stored)."""
    raw = txn.get(_NEXT_KEY, db=h.info)
    next_id = _ID.unpack(raw)[0] if raw is not None and len(raw) == _ID.size else 1
    for db in (h.packs, h.packlive):
        with txn.cursor(db=db) as cursor:
            if cursor.last():
                next_id = max(next_id, _ID.unpack(cursor.key())[0] + 1)
    return next_id


def recount_packs(txn: lmdb.Transaction[Any], h: PackDbs) -> None:
    """Count every pack's live entries from the ``slots`` db again (``rebuild_totals``,
    after it removed the slots it cannot trust); delete the packs no slot uses."""
    live: dict[bytes, list[int]] = {}
    for raw in txn.cursor(db=h.slots).iternext(keys=False):
        slot = read_slot(raw)
        if slot is not None:
            rec = live.setdefault(_ID.pack(slot[0]), [0, 0])
            rec[0] += 1
            rec[1] += slot[2]
    lengths = {bytes(pid): len(pack) for pid, pack in txn.cursor(db=h.packs)}
    for pid, size in lengths.items():
        counts = live.get(pid)
        if counts is None:
            txn.delete(pid, db=h.packs)
            txn.delete(pid, db=h.packlive)
        else:
            txn.put(pid, _LIVE.pack(counts[0], counts[1], size), db=h.packlive)
    for pid in list(txn.cursor(db=h.packlive).iternext(values=False)):
        if bytes(pid) not in lengths:
            txn.delete(bytes(pid), db=h.packlive)
