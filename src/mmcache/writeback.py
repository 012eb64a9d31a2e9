"""The write-behind of a :class:`~mmcache.cache.Cache` (the loader's import path).

The mechanism lives in :mod:`mmcache.stores.writebehind` and writes the
cache's :class:`~mmcache.stores.tiered.TieredStore`; this module binds it to a
cache (its tiers and its fingerprint tags) and keeps ``write_behind``,
``flush_all`` and ``WriteBehind(cache)`` importable from here.
"""

from __future__ import annotations

from collections.abc import Callable

from mmcache.cache import Cache
from mmcache.stores import writebehind as _wb
from mmcache.stores.writebehind import GROUP_BYTES, MAX_PENDING, flush_all

__all__ = [
    "GROUP_BYTES",
    "MAX_PENDING",
    "WriteBehind",
    "flush_all",
    "pending_write",
    "write_behind",
]


class WriteBehind(_wb.WriteBehind):
    """The background writer of one :class:`Cache` in one process (see the store-level
    :class:`mmcache.stores.writebehind.WriteBehind`); tags go to ``cache.tag``."""

    def __init__(self, cache: Cache, *, max_pending: int = MAX_PENDING) -> None:
        super().__init__(cache.store, max_pending=max_pending, tag=cache.tag)
        self.cache = cache


def write_behind(cache: Cache) -> Callable[..., bool]:
    """The ``submit(key, raw, cost, tag=None)`` of this process's writer for ``cache``
    (created on first use)."""
    return _wb.writer_for(cache, lambda: WriteBehind(cache)).submit


def pending_write(cache: Cache, key: bytes) -> bytes | None:
    """The encoded entry of ``key`` if this process's writer for ``cache`` still holds it
    uncommitted (see :meth:`mmcache.stores.writebehind.WriteBehind.pending`), else None."""
    writer = _wb.writer_if_any(cache)
    return None if writer is None else writer.pending(key)
