"""Fetch groups: the byte spans of samples in remote objects (shards), grouped into runs of
neighbouring spans that one ranged GET fetches together.

A cold epoch that issued one GET per sample would be bound by the store's rate of
requests (and its per-request latency and price), not by bandwidth. So the spans of each
object are cut into groups by the aligned block of ``block`` bytes their start falls in:
a group is the run of spans starting in one block, and it is fetched with one GET of
``[first start, last end)`` (a little over ``block`` bytes at most: its last span may run
past the block's end; it never reads past the last span, so a shard's last block is
simply shorter and a truncated shard is never read beyond its last whole member). The
fetched bytes are cut back into the spans and each is kept in the raw tier under its
own key (URL + version stamp + span), exactly as if it had been fetched alone: what
serves a sample does not change, and a changed object gets new stamps, hence new keys.

:class:`FetchGroups` is computed from numpy columns (no per-sample Python objects) and
is read-only after construction: thread-safe.
"""

from __future__ import annotations

import numpy as np

from mmcache.errors import ConfigError
from mmcache.units import parse_size

__all__ = ["DEFAULT_BLOCK", "FetchGroups", "check_block"]

#: Default block of a fetch group: large enough that a COCO-sized shard of 200 samples
#: (~14 MiB) is two GETs, small enough that a group arrives in one round trip plus a
#: fraction of a second on a slow link.
DEFAULT_BLOCK = 8 << 20


def check_block(block: int | str | None) -> int:
    """``block`` in bytes (an int, ``"8MiB"``); ``None`` or ``0``: one span per GET."""
    if block is None:
        return 0
    try:
        value = parse_size(block)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"fetch_block must be a size (bytes or '8MiB') or None: {exc}") from exc
    if value < 0:
        raise ConfigError(f"fetch_block must be >= 0, got {block!r}")
    return value


class FetchGroups:
    """Groups of the spans ``[start[i], end[i])`` of object ``obj[i]`` (``-1``: sample ``i``
    has no remote bytes) by aligned block of ``block`` bytes (``0``: one group per span).

    ``group_of[i]`` is sample ``i``'s group (``-1``: none); :meth:`members` the samples
    of a group in offset order; ``g_obj``, ``g_start``, ``g_end`` each group's object and
    byte range.
    """

    def __init__(self, obj: np.ndarray, start: np.ndarray, end: np.ndarray, *, block: int):
        obj = np.asarray(obj, dtype=np.int64)
        start = np.asarray(start, dtype=np.int64)
        end = np.asarray(end, dtype=np.int64)
        n = obj.shape[0]
        valid = (obj >= 0) & (end > start)
        picked = np.flatnonzero(valid)
        self.group_of = np.full(n, -1, dtype=np.int64)
        # the block each span starts in; with no block, one group per span
        cell = start[picked] // block if block > 0 else np.arange(picked.shape[0])
        order = np.lexsort((start[picked], cell, obj[picked]))
        picked, cell = picked[order], cell[order]
        o = obj[picked]
        new = np.ones(picked.shape[0], dtype=bool)
        new[1:] = (o[1:] != o[:-1]) | (cell[1:] != cell[:-1])
        number = np.cumsum(new) - 1
        self.group_of[picked] = number
        self.order = picked
        self.bounds = np.append(np.flatnonzero(new), picked.shape[0]).astype(np.int64)
        firsts = self.bounds[:-1]
        self.g_obj = o[firsts] if picked.size else np.zeros(0, dtype=np.int64)
        self.g_start = np.minimum.reduceat(start[picked], firsts) if picked.size else o[:0]
        self.g_end = np.maximum.reduceat(end[picked], firsts) if picked.size else o[:0]

    def __len__(self) -> int:
        return int(self.g_obj.shape[0])

    def members(self, group: int) -> np.ndarray:
        """The samples of ``group``, in offset order."""
        out: np.ndarray = self.order[self.bounds[group] : self.bounds[group + 1]]
        return out
