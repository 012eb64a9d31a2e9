"""The read check of a batch gather: every entry a tier gathers is checked before it is served.

A gathering tier (:class:`~mmcache.stores.base.BatchReader`) copies byte ranges of
many entries into a batch; what makes an entry intact is the codec's business
(its xxh3 checksum), not the store's, so the owner (the cache) hands the check
in and the store stays bytes-only: :class:`GatherCheck` holds it.

Each entry is copied, then checked, before the next one is copied: the check reads
the copies just made, while they are still in the CPU cache, and what is served is
what was checked (a byte changed in ``/dev/shm`` after the copy is not in the copy).
Two forms:

* :meth:`GatherCheck.copy_checked_rows`, the memory tier's: entries of one size in one
  2-D array of slots (a size class's slab). The small ranges (header, token ids) and
  the small gaps between ranges are copied for the whole batch by one fancy-indexing
  step each; then, entry by entry, its large ranges (the image) are copied and the
  entry hashed from the copies, both in ``codec.checksums_match_rows`` (what to copy
  and hash worked out once per batch, handed over as data: no Python call per entry):
  ~2 microseconds of Python per entry beside the copy and the hash, which both
  release the GIL (numpy's copy; ``xxhash``'s ``update`` above
  64 KiB), so two assembling threads overlap.
* :meth:`GatherCheck.copy_checked`, for entries given one by one
  (``codec.checksum_matches_copied``, given the ``(offset, copy)`` of every range,
  the bytes between the ranges read from the entry itself): any layout of ranges;
  targets whose ranges overlap, or whose rows are not contiguous, are checked on the
  entry itself (``codec.checksum_matches``).

Used by the memory tier (and the cluster's in-flight tier, a memory store);
the disk tier interleaves the same two checks with its copies
(:mod:`mmcache.stores.disk.gather`). Pure: thread- and process-safe.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = [
    "CopiedCheck",
    "EntryCheck",
    "GatherCheck",
    "RowsCheck",
    "Targets",
    "ranges_apart",
    "tile_ranges",
]

#: The read check of a gathered entry: whether its bytes are intact (``codec.checksum_matches``).
EntryCheck = Callable[[memoryview], bool]
#: The read check given the copies of byte ranges of the entry (``(offset, copy)``,
#: sorted by offset, apart): ``codec.checksum_matches_copied``.
CopiedCheck = Callable[[memoryview, Sequence[tuple[int, npt.NDArray[np.uint8]]]], bool]
#: One large range copied entry by entry by the rows check, ``(out, src, start, stop)``:
#: entry ``j``'s ``src[sources[j], start:stop]`` into ``out[rows[j]]``, just before its hash.
RowCopy = tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], int, int]


class RowsCheck(Protocol):
    """The read check of a batch of entries of one size from copies of pieces that tile
    them, copying the large ranges (``copies``) entry by entry just before each entry is
    hashed: ``codec.checksums_match_rows``."""

    def __call__(
        self,
        size: int,
        pieces: Sequence[tuple[int, npt.NDArray[np.uint8]]],
        rows: Sequence[int],
        before: Callable[[int], None] | None = None,
        *,
        copies: Sequence[RowCopy] = (),
        sources: Sequence[int] = (),
    ) -> npt.NDArray[np.bool_]: ...


#: Ranges and gaps up to this long are copied for a whole batch in one fancy-indexing
#: step (its temporary is small, and a row copy in Python per entry costs more).
SMALL_RANGE = 4096
#: The ``(offset, length, out)`` ranges of one gather.
Targets = Sequence[tuple[int, int, npt.NDArray[np.uint8]]]


def ranges_apart(targets: Targets) -> bool:
    """Whether the targets' ranges do not overlap and their rows are contiguous (what
    a check over the copies needs)."""
    spans = sorted((offset, offset + length) for offset, length, _ in targets)
    if any(b[0] < a[1] for a, b in itertools.pairwise(spans)):
        return False
    return all(out.strides[1] == 1 for _, _, out in targets)


def tile_ranges(
    targets: Targets, size: int, m: int
) -> (
    tuple[list[tuple[int, npt.NDArray[np.uint8]]], list[tuple[int, int, npt.NDArray[np.uint8]]]]
    | None
):
    """What a batch check of entries of ``size`` bytes needs of ``targets`` (ranges apart,
    ``m`` rows): the pieces that tile ``[0, size)`` as ``(offset, array)`` (each target's
    rows, and an ``[m, gap]`` temporary for each gap between or after the ranges: hashed,
    never served), and the same pieces as ``(start, stop, array)`` to copy an entry into.
    None where a gap is longer than :data:`SMALL_RANGE` (its temporary would be large):
    the caller checks entry by entry instead."""
    spans: list[tuple[int, int, npt.NDArray[np.uint8] | None]] = [
        (offset, offset + length, out) for offset, length, out in targets if length
    ]
    spans.sort(key=lambda t: t[0])
    pieces: list[tuple[int, npt.NDArray[np.uint8]]] = []
    tiles: list[tuple[int, int, npt.NDArray[np.uint8]]] = []
    pos = 0
    for start, stop, out in [*spans, (size, size, None)]:
        if start > pos:
            if start - pos > SMALL_RANGE:
                return None
            gap = np.empty((m, start - pos), dtype=np.uint8)
            pieces.append((pos, gap))
            tiles.append((pos, start, gap))
        if out is not None:
            pieces.append((start, out))
            tiles.append((start, stop, out))
        pos = stop
    return pieces, tiles


class GatherCheck:
    """The entry check a gathering tier runs on what it copied (see the module docstring)."""

    __slots__ = ("check", "copied", "rows")

    def __init__(
        self, check: EntryCheck, copied: CopiedCheck | None = None, rows: RowsCheck | None = None
    ) -> None:
        self.check = check
        self.copied = copied
        self.rows = rows

    def copy_checked_rows(
        self,
        slab: npt.NDArray[np.uint8],
        rows: npt.NDArray[np.int64],
        slots: npt.NDArray[np.int64],
        size: int,
        targets: Targets,
    ) -> npt.NDArray[np.bool_] | None:
        """Copy entry ``j`` (``slab[slots[j], :size]``, every entry ``size`` bytes) into row
        ``rows[j]`` of each target and check it (see the module docstring); per entry,
        whether it failed (True: do not serve that row). None, with nothing copied,
        where this form does not apply (no rows check, ranges that overlap or rows not
        contiguous, a large gap between ranges): the caller uses :meth:`copy_checked`."""
        rows_check = self.rows
        if rows_check is None or not targets or not ranges_apart(targets):
            return None
        tiled = tile_ranges(targets, size, targets[0][2].shape[0])
        if tiled is None:
            return None
        pieces, tiles = tiled
        batched = [t for t in tiles if t[1] - t[0] <= SMALL_RANGE]  # copied for the batch
        large = [t for t in tiles if t[1] - t[0] > SMALL_RANGE]  # copied entry by entry
        for start, stop, out in batched:
            out[rows] = slab[slots, start:stop]
        copies = [(out, slab, start, stop) for start, stop, out in large]
        ok = rows_check(size, pieces, rows.tolist(), None, copies=copies, sources=slots.tolist())
        bad: npt.NDArray[np.bool_] = ~ok
        return bad

    def copy_checked(
        self,
        rows: Sequence[int],
        entries: Sequence[npt.NDArray[np.uint8]],
        targets: Targets,
    ) -> npt.NDArray[np.bool_]:
        """Copy each entry's ranges into its row (``entries[j]``, the whole entry, into row
        ``rows[j]`` of each target) and check it; per entry, whether it failed (True: do
        not serve that row). Entry by entry, so each check reads copies still in the CPU
        cache (a whole batch copied first would be out of it: 64 images are ~10 MB)."""
        bad = np.zeros(len(rows), dtype=bool)
        order = sorted(targets, key=lambda t: t[0])
        copied = self.copied if self.copied is not None and ranges_apart(targets) else None
        for j, (r, entry) in enumerate(zip(rows, entries, strict=True)):
            if copied is None:
                bad[j] = not self.check(entry.data)
                if not bad[j]:
                    for offset, length, out in order:
                        out[r] = entry[offset : offset + length]
                continue
            copies = []
            for offset, length, out in order:
                dst = out[r]
                dst[...] = entry[offset : offset + length]
                copies.append((offset, dst))
            bad[j] = not copied(entry.data, copies)
        return bad
