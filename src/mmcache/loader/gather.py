"""The hit path: gather a batch's cached entries from the cache's reader into batch tensors.

All byte ranges of all keys of a batch are copied under one shared lock
(:meth:`~mmcache.stores.base.BatchReader.gather_ranges`; over memory then
disk, :class:`~mmcache.stores.gathering.TieredReader`), so an entry
evicted and replaced by another process in between can never mix into the
batch; which ranges, and how their headers are checked, is
:mod:`mmcache.loader.batchlayout`'s. Hits never travel through a worker.

Copies are numpy's, never torch's: a torch copy large enough to run on the
intra-op (OpenMP) pool hangs in a process forked from one that used that pool
(a training loop started with multiprocessing "fork"), seen in the crash tests.

:class:`BufferPool` recycles the batch tensors the training loop let go of.

Thread safety: :func:`gather_hits` is pure but for the reader (thread- and
process-safe); :class:`BufferPool` is used under its caller's lock.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np
import torch

from mmcache import codec
from mmcache.loader.batchlayout import byte_ranges, expired_rows, head_matches
from mmcache.stores.base import BatchReader
from mmcache.stores.gathering import gather_sources

__all__ = ["BufferPool", "Gathered", "gather_hits"]


class Gathered(NamedTuple):
    """What :func:`gather_hits` found, per key: ``ok`` (copied into the batch),
    ``corrupt`` (present with another layout: damaged), ``expired`` (TTL) and
    ``tier`` (the index of the reader's tier that held it, ``-1``: none;
    :func:`~mmcache.stores.gathering.reader_names`)."""

    ok: np.ndarray
    corrupt: np.ndarray
    expired: np.ndarray
    tier: np.ndarray


def gather_hits(
    reader: BatchReader,
    layout: codec.Header,
    keys: np.ndarray,
    rows: np.ndarray,
    out: dict[str, torch.Tensor],
    *,
    ttl_cutoff: float | None,
    count: bool = True,
) -> Gathered:
    """Gather the fields of ``keys`` (``uint8 [n, 16]``) from ``reader`` into rows
    ``rows`` of ``out``.

    An entry whose header or field table differs from ``layout``, or that
    expired, is treated as absent (and named in the result, for the caller to
    drop): the caller produces those instead. ``count=False``: the tier's hit
    and miss counters are left alone (the caller counts what it serves).
    """
    n = len(keys)
    ranges = byte_ranges(layout)
    full = len(rows) == next(iter(out.values())).shape[0]
    targets: list[tuple[int, int, np.ndarray]] = []
    seg_bufs: list[np.ndarray] = []
    direct: dict[str, np.ndarray] = {}
    for start, stop, names in ranges.segments:
        if full and len(names) == 1 and start == ranges.offsets[names[0]][0] and start > 0:
            f = names[0]
            dst = out[f].numpy().reshape(n, -1).view(np.uint8)  # straight into the batch
            direct[f] = dst
            seg_bufs.append(dst)
        else:
            dst = np.empty((n, stop - start), dtype=np.uint8)
            seg_bufs.append(dst)
        targets.append((start, stop - start, dst))
    tier = gather_sources(reader, keys, targets, count=count)
    found = tier >= 0
    head = seg_bufs[0][:, : ranges.table_end]
    foreign = found & ~head_matches(head, ranges)
    ok = found & ~foreign
    expired = np.zeros(n, dtype=bool)
    if ttl_cutoff is not None:
        expired = ok & expired_rows(head, ttl_cutoff)
        ok &= ~expired
    all_ok = bool(ok.all())
    sel_rows = rows[ok]
    for (start, _stop, names), buf in zip(ranges.segments, seg_bufs, strict=True):
        for name in names:
            if name in direct:
                continue
            off, nbytes, dtype, shape = ranges.offsets[name]
            if nbytes == 0:  # an empty field (a text-only sample's images): nothing to copy
                continue
            src = buf[:, off - start : off - start + nbytes]
            if not all_ok:
                src = src[ok]
            if src.shape[0] == 0:
                continue
            arr = np.ascontiguousarray(src).view(dtype).reshape(-1, *shape)
            if full and all_ok:
                out[name].numpy()[...] = arr
            else:
                out[name].numpy()[sel_rows] = arr
    return Gathered(ok, foreign, expired, tier)


class BufferPool:
    """Recycles batch tensors that nobody outside the pool references any more.

    A fresh 10 MB batch tensor costs a page fault per 4 KiB page when it is
    first written (glibc returns large freed blocks to the OS): about as much
    as the copy itself. A buffer is reused only when both its Python reference
    count and its storage's use count (tensors, views, ``.numpy()`` arrays of
    it) are back to what they were when the pool alone held it, so a batch (or
    any view of it) the training loop still holds is never overwritten.
    Without torch's use-count hook the pool stays empty and every batch is
    fresh. Used by one thread at a time.
    """

    _MAX = 8

    def __init__(self, *, enabled: bool) -> None:
        self._use_count = getattr(torch._C, "_storage_Use_Count", None)
        self.enabled = enabled and self._use_count is not None
        self._entries: list[tuple[bytes, int, dict[str, torch.Tensor], dict[str, int]]] = []

    def _use(self, held: dict[str, torch.Tensor], name: str) -> int:
        use = self._use_count(held[name].untyped_storage()._cdata) if self._use_count else 0
        return int(use)

    @staticmethod
    def _refs(held: dict[str, torch.Tensor], name: str) -> int:
        # Only the pool's dict and getrefcount's own argument: 2. Evaluated on a
        # subscript so no local variable of ours adds a reference.
        return sys.getrefcount(held[name])

    def acquire(self, layout_key: bytes, n: int) -> dict[str, torch.Tensor] | None:
        if not self.enabled:
            return None
        for key, size, held, base in self._entries:
            if key != layout_key or size != n:
                continue
            if all(
                self._refs(held, name) == 2 and self._use(held, name) == use
                for name, use in base.items()
            ):
                return dict(held)
        return None

    def add(self, layout_key: bytes, n: int, tensors: dict[str, torch.Tensor]) -> None:
        if not self.enabled:
            return
        held = dict(tensors)
        base = {name: self._use(held, name) for name in held}
        self._entries.append((layout_key, n, held, base))
        if len(self._entries) > self._MAX:
            self._entries.pop(0)
