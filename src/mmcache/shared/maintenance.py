"""What a share holds (``mmcache stats --shared URL``) and removing what is old
(``mmcache gc --shared URL --older-than 30d``).

A share keeps no access times (a read writes nothing), so age is the time an entry was
produced: ``gc`` removes every pack whose newest entry is older than the cutoff (an
entry still in use is then produced again by its next reader and published anew). A
pack is removed index first, so no reader finds it half gone; a reader that merged its
index before reads a pack that is not there, drops it and produces those entries. Packs
without an index (a writer killed before its commit) are removed once older than
``grace`` (an upload in progress is younger than that), and so are indexes that cannot
be read, once older than the cutoff.

Both walk the share's listing and read every index (bounded, as readers do); nothing
else is read. Safe while jobs read and publish.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from mmcache.errors import CorruptEntryError, RemoteError
from mmcache.shared.access import Listed, Share
from mmcache.shared.layout import MAX_INDEX_BYTES, decode_index, pack_time
from mmcache.units import parse_duration

__all__ = ["ShareGcReport", "ShareStats", "gc_share", "share_stats"]

#: Packs without an index younger than this are left alone (their writer may be uploading).
GRACE = 3600.0


@dataclass(frozen=True)
class ShareStats:
    """What a share holds: committed ``packs``, their ``entries`` and ``bytes``; packs
    without an index (``uncommitted``: being written, or left by a killed writer) and their
    bytes; indexes that cannot be read (``damaged``); the creation times of the oldest
    and newest entries (0.0 when empty)."""

    url: str
    packs: int
    entries: int
    bytes: int
    index_bytes: int
    uncommitted: int
    uncommitted_bytes: int
    damaged: tuple[str, ...]
    oldest: float
    newest: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ShareGcReport:
    """What :func:`gc_share` removed: packs (and their entries and bytes), packs without
    an index, damaged indexes."""

    url: str
    packs: int
    entries: int
    freed_bytes: int
    uncommitted: int
    damaged: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _walk(share: Share) -> tuple[list[tuple[Listed, Any]], list[Listed], dict[str, Listed]]:
    """The committed packs with their index (or the reason it cannot be read), and the
    packs by name."""
    indexes = share.list_indexes()
    packs = {p.pack: p for p in share.list_packs()}
    readable = [e for e in indexes if e.size <= MAX_INDEX_BYTES]
    out: list[tuple[Listed, Any]] = [
        (e, f"{e.size} bytes, over {MAX_INDEX_BYTES}") for e in indexes if e not in readable
    ]
    for entry, data in zip(readable, share.read_indexes(readable), strict=True):
        if isinstance(data, RemoteError):
            if data.kind == "not-found":
                continue  # removed since the listing
            raise data
        try:
            out.append((entry, decode_index(data, name=entry.pack)))
        except CorruptEntryError as exc:
            out.append((entry, str(exc)))
    committed = {e.pack for e in indexes}
    return out, [p for name, p in packs.items() if name not in committed], packs


def share_stats(
    location: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> ShareStats:
    """Count a share's packs, entries and bytes (see the module docstring)."""
    share = Share(location, storage_options=dict(storage_options or {}))
    try:
        walked, loose, packs = _walk(share)
    finally:
        share.close()
    good = [(e, ix) for e, ix in walked if not isinstance(ix, str)]
    times = [t for _, ix in good if len(ix) for t in (float(ix.ctime.min()), ix.newest)]
    return ShareStats(
        url=share.describe(),
        packs=len(good),
        entries=sum(len(ix) for _, ix in good),
        bytes=sum(packs[e.pack].size if e.pack in packs else ix.nbytes for e, ix in good),
        index_bytes=sum(e.size for e, _ in walked),
        uncommitted=len(loose),
        uncommitted_bytes=sum(p.size for p in loose),
        damaged=tuple(e.pack for e, ix in walked if isinstance(ix, str)),
        oldest=min(times, default=0.0),
        newest=max(times, default=0.0),
    )


def gc_share(
    location: str | os.PathLike[str],
    *,
    older_than: float | str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    grace: float = GRACE,
    clock: Callable[[], float] = time.time,
) -> ShareGcReport:
    """Remove the packs whose newest entry is older than ``older_than`` (seconds or
    ``"30d"``; None: none), packs without an index older than ``grace`` seconds, and
    unreadable indexes older than ``older_than`` (see the module docstring)."""
    share = Share(location, storage_options=dict(storage_options or {}))
    now = clock()
    cutoff = None if older_than is None else now - parse_duration(older_than)
    removed = entries = freed = damaged = loose_removed = 0
    try:
        walked, loose, packs = _walk(share)
        for entry, ix in walked:
            size = packs[entry.pack].size if entry.pack in packs else 0
            if isinstance(ix, str):
                old = cutoff is not None and pack_time(entry.pack) < cutoff
                if old:
                    share.remove(entry.pack)
                    damaged += 1
                    freed += size
                continue
            if cutoff is not None and (ix.newest if len(ix) else ix.created) < cutoff:
                share.remove(entry.pack)
                removed += 1
                entries += len(ix)
                freed += size
        for pack in loose:
            if pack_time(pack.pack) < now - grace:
                share.remove(pack.pack)
                loose_removed += 1
                freed += pack.size
    finally:
        share.close()
    return ShareGcReport(
        url=share.describe(),
        packs=removed,
        entries=entries,
        freed_bytes=freed,
        uncommitted=loose_removed,
        damaged=damaged,
    )
