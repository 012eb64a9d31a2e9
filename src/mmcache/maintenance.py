"""Maintenance of a cache's tiers: ``verify`` (checksums) and ``gc`` (what to remove).

These run from the CLI (``mmcache verify``, ``mmcache gc``) on a reopened root,
or from ``Cache.verify``/``Cache.gc``, while other processes may be using the
cache: every step goes through the tiers' own process-safe methods. They count
no hits or misses and leave the policy's order alone, so maintenance never
changes what training sees next except by removing entries.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mmcache import codec
from mmcache.cacheroot import memory_group
from mmcache.errors import CacheError
from mmcache.registry import FingerprintRegistry
from mmcache.stores.base import ChecksEntries, Salvages, Store
from mmcache.stores.disk.maintenance import DamagedTreeError
from mmcache.units import parse_duration, parse_size

__all__ = [
    "GcReport",
    "Maintained",
    "VerifyReport",
    "damaged_tiers",
    "gc",
    "reclaim_memory",
    "sweep_orphans",
    "verify",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GcReport:
    """What :meth:`Cache.gc <mmcache.cache.Cache.gc>` removed."""

    expired: int = 0
    corrupt: int = 0
    evicted: int = 0
    freed_bytes: int = 0
    orphan_segments: tuple[str, ...] = ()
    dropped_fingerprints: tuple[str, ...] = ()
    dropped_entries: int = 0
    #: WebDataset member indexes removed from ``ROOT/wds-index`` (shard gone or changed).
    index_files: tuple[str, ...] = ()
    #: Reject logs of this user's ended processes removed from the temporary folder
    #: (:func:`~mmcache.sources.rejects.sweep_reject_logs`).
    reject_logs: tuple[str, ...] = ()
    #: Column files of manifests gone or changed removed from this user's folder
    #: (:func:`~mmcache.sources.nodecolumns.sweep_stale_columns`).
    column_files: int = 0
    #: Key tables of column files gone, or unused for 30 days, removed from that folder
    #: (:func:`~mmcache.sources.keytable.sweep_tables`).
    key_tables: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class VerifyReport:
    """What :meth:`Cache.verify <mmcache.cache.Cache.verify>` found: entries checked, bad
    keys (hex), removed count, the tiers checked (fastest first) and, for each bad
    key, the tier holding it."""

    checked: int
    bad: tuple[str, ...]
    removed: int
    tiers: tuple[str, ...] = ()
    bad_tiers: tuple[str, ...] = ()
    #: Tiers whose file is damaged beyond single entries (a B-tree page), with why.
    damaged: dict[str, str] = field(default_factory=dict)
    #: Tiers repaired by a salvage into a fresh file: entries kept and lost.
    salvaged: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.bad and not self.damaged

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def _verifies(buf: bytes) -> bool:
    return codec.verify(buf)


def verify(tiers: Mapping[str, Store], *, repair: bool = False) -> VerifyReport:
    """Check every entry's header and checksum in each of ``tiers`` (by name, fastest
    first); with ``repair`` remove bad ones.

    Each tier checks itself where it can (a :class:`~mmcache.stores.base.ChecksEntries`:
    the memory and disk tiers): no hit or miss is counted and no access time changes, so verifying
    leaves the statistics and the policy's order as they were. Bad entries are
    counted as ``corrupt`` by the tier. Safe while other processes use the cache.

    A tier whose file is damaged beyond single entries (a B-tree page that
    cannot be read: :class:`~mmcache.stores.disk.maintenance.DamagedTreeError`)
    is listed in ``damaged``; with ``repair`` it is salvaged instead (its
    readable entries copied into a fresh file, which needs no other process to
    have it open) and then checked, and the counts are in ``salvaged``.
    """
    bad: list[tuple[str, bytes]] = []
    damaged: dict[str, str] = {}
    salvaged: dict[str, dict[str, int]] = {}
    checked = 0
    for name, tier in tiers.items():
        if isinstance(tier, ChecksEntries):  # counts what it finds as corrupt
            try:
                found = list(tier.verify(_verifies))
            except DamagedTreeError as exc:
                if not repair or not isinstance(tier, Salvages):
                    damaged[name] = str(exc)
                    continue
                report = tier.salvage()  # what is readable, into a fresh file; then check it
                salvaged[name] = {"kept": report.kept, "lost": report.lost}
                found = list(tier.verify(_verifies))
            checked += len(tier)
        else:  # a tier without its own check: plain reads (they count as hits)
            checked += len(tier)
            found = []
            for k in list(tier.keys()):
                raw = tier.get(k)
                if raw is not None and not _verifies(raw):
                    found.append(k)
        for k in found:
            bad.append((name, k))
            if repair and isinstance(tier, ChecksEntries):
                tier.delete(k)
            elif repair:
                tier.discard(k, why="corrupt")
    return VerifyReport(
        checked=checked,
        bad=tuple(k.hex() for _, k in bad),
        removed=len(bad) if repair else 0,
        tiers=tuple(tiers),
        bad_tiers=tuple(name for name, _ in bad),
        damaged=damaged,
        salvaged=salvaged,
    )


def damaged_tiers(tiers: Mapping[str, Store]) -> dict[str, str]:
    """``{tier: why}`` for the tiers whose file cannot be walked (``mmcache stats``):
    a walk of the keys, not of the values, so it costs far less than :func:`verify`."""
    found: dict[str, str] = {}
    for name, tier in tiers.items():
        why = tier.tree_problem() if isinstance(tier, Salvages) else None
        if why is not None:
            found[name] = why
    return found


class Maintained(Protocol):
    """What :func:`gc` needs of a cache (:class:`~mmcache.cache.Cache` has it)."""

    root: Path
    mode: int
    ttl: float | None
    clock: Callable[[], float]
    registry: FingerprintRegistry | None

    @property
    def tiers(self) -> dict[str, Store]: ...

    @property
    def memory_name(self) -> str: ...

    def resize_disk(self, capacity: int | str) -> int: ...


def reclaim_memory(cache: Maintained, *, all_roots: bool = False) -> tuple[str, ...]:
    """Remove this root's memory tier if it is damaged (a truncated or missing data
    segment) or unused and temporary, and the unused memory tiers of the root's
    earlier incarnations (removed and made again at its path), when nobody is attached
    (``all_roots``: every such store of this user or group); return the files
    removed. Process-safe (see :func:`~mmcache.stores.memory.reclaim_orphans`)."""
    from mmcache.stores.memory import reclaim_orphans

    group = memory_group(cache.root, cache.mode)
    if all_roots:
        return tuple(reclaim_orphans("*", group=group))
    mine = reclaim_orphans(cache.memory_name, group=group)
    return tuple(mine + reclaim_orphans(owner=str(cache.root), group=group))


def gc(
    cache: Maintained,
    *,
    older_than: float | str | None = None,
    max_size: int | str | None = None,
    unused_for: float | str | None = None,
    all_roots: bool = False,
) -> GcReport:
    """Remove expired and corrupt entries and orphaned shared-memory segments.

    ``older_than`` (seconds or ``"7d"``) also removes, this once, every entry
    created longer ago than that (the cache's ``ttl`` stays as it is).

    Orphaned segments: this root's memory tier when it is damaged or unused
    and temporary (see :func:`~mmcache.stores.memory.reclaim_orphans`);
    ``all_roots`` also those of every other root of this user (or group).

    ``max_size`` shrinks the disk tier's budget to that size (evicting by the
    policy; ``keep``/``value`` fall back to least recently used) and records
    the new budget for later opens. ``unused_for`` (seconds or ``"30d"``)
    removes every entry of the pipeline fingerprints not used for that long.

    WebDataset member indexes kept under the root (``ROOT/wds-index``) whose
    local shard is gone or changed are removed too
    (:func:`~mmcache.sources.wds.home.sweep_indexes`), and so are the reject logs
    that killed processes of this user left in the temporary folder (the next
    process that makes one removes them too, but none may come:
    :func:`~mmcache.sources.rejects.sweep_reject_logs`), and this user's manifest column
    files whose manifest is gone or changed, with the key tables of those (or unused for 30
    days) (:func:`~mmcache.sources.nodecolumns.sweep_stale_columns`).
    """
    from mmcache.sources.nodecolumns import sweep_stale_columns
    from mmcache.sources.rejects import sweep_reject_logs
    from mmcache.sources.wds.home import INDEX_FOLDER, sweep_indexes

    ages = [a for a in (cache.ttl, older_than) if a is not None]
    before = sum(t.nbytes() for t in cache.tiers.values())
    expired = 0
    if ages:
        cutoff = cache.clock() - min(parse_duration(a) for a in ages)
        for tier in cache.tiers.values():
            expired += tier.expire(cutoff)
    dropped: list[str] = []
    removed_by_fp = 0
    registry = cache.registry
    if unused_for is not None and registry is not None:
        cutoff = cache.clock() - parse_duration(unused_for)
        for info in registry.entries():
            if info.last_used >= cutoff:
                continue
            for k in registry.keys(info.fingerprint):
                for tier in cache.tiers.values():
                    removed_by_fp += int(tier.delete(k))
            registry.remove(info.fingerprint)
            dropped.append(info.fingerprint)
    report = verify(cache.tiers, repair=True)
    evicted = cache.resize_disk(parse_size(max_size)) if max_size is not None else 0
    orphans = reclaim_memory(cache, all_roots=all_roots)
    after = sum(t.nbytes() for t in cache.tiers.values())
    indexes = tuple(sweep_indexes(str(cache.root / INDEX_FOLDER)))
    columns, tables = sweep_stale_columns()
    return GcReport(
        expired=expired,
        corrupt=len(report.bad),
        evicted=evicted,
        freed_bytes=max(before - after, 0),
        orphan_segments=orphans,
        dropped_fingerprints=tuple(dropped),
        dropped_entries=removed_by_fp,
        index_files=indexes,
        reject_logs=tuple(sweep_reject_logs()),
        column_files=columns,
        key_tables=tables,
    )


def sweep_orphans() -> GcReport:
    """Remove the node's orphaned memory stores of every root, without opening one
    (``mmcache gc --all`` without ``--cache``): those of this user and of each of its
    groups that has a store directory (roots shared with ``mode=0o660``).

    What goes is what :func:`~mmcache.stores.memory.reclaim_orphans` removes:
    stores nobody is attached to that are temporary, whose root is gone or whose
    segments are damaged. No cache root is needed, because a root that no longer
    exists is exactly what leaves its store behind. A group's directory that
    another user could control is skipped with a warning (never used, never
    emptied); this user's own raises :class:`~mmcache.errors.CacheError`.
    The reject logs of this user's ended processes and the column files of manifests
    gone or changed go too (as in :func:`gc`). Process-safe.
    """
    from mmcache.sources.nodecolumns import sweep_stale_columns
    from mmcache.sources.rejects import sweep_reject_logs
    from mmcache.stores.memory import reclaim_orphans

    removed = list(reclaim_orphans("*"))
    for group in sorted({os.getegid(), *os.getgroups()}):
        try:
            removed += reclaim_orphans("*", group=group)
        except CacheError as exc:  # UntrustedFileError: not ours to sweep
            logger.warning("skipping the memory stores of group %d: %s", group, exc)
    columns, tables = sweep_stale_columns()
    return GcReport(
        orphan_segments=tuple(removed),
        reject_logs=tuple(sweep_reject_logs()),
        column_files=columns,
        key_tables=tables,
    )
