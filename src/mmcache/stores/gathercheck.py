"""The read check of a batch gather: every entry a tier gathers is checked before it is served.

A gathering tier (:class:`~mmcache.stores.base.BatchReader`) copies byte ranges of
many entries into a batch; what makes an entry intact is the codec's business
(its xxh3 checksum), not the store's, so the owner (the cache) hands the check
in and the store stays bytes-only: :class:`GatherCheck` holds it.

Each entry is copied, then checked, before the next one is copied: the check reads
the copies just made, while they are still in the CPU cache
(``codec.checksum_matches_copied``, given the ``(offset, copy)`` of every range,
the bytes between the ranges read from the entry itself): one pass over the
entry's bytes in memory, not two. Targets whose ranges overlap, or whose rows
are not contiguous, are checked on the entry itself (``codec.checksum_matches``).

Used by the memory tier (and the cluster's in-flight tier, a memory store);
the disk tier interleaves the same two checks with its copies
(:mod:`mmcache.stores.disk.gather`). Pure: thread- and process-safe.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["CopiedCheck", "EntryCheck", "GatherCheck", "Targets", "ranges_apart"]

#: The read check of a gathered entry: whether its bytes are intact (``codec.checksum_matches``).
EntryCheck = Callable[[memoryview], bool]
#: The read check given the copies of byte ranges of the entry (``(offset, copy)``,
#: sorted by offset, apart): ``codec.checksum_matches_copied``.
CopiedCheck = Callable[[memoryview, Sequence[tuple[int, npt.NDArray[np.uint8]]]], bool]
#: The ``(offset, length, out)`` ranges of one gather.
Targets = Sequence[tuple[int, int, npt.NDArray[np.uint8]]]


def ranges_apart(targets: Targets) -> bool:
    """Whether the targets' ranges do not overlap and their rows are contiguous (what
    a check over the copies needs)."""
    spans = sorted((offset, offset + length) for offset, length, _ in targets)
    if any(b[0] < a[1] for a, b in itertools.pairwise(spans)):
        return False
    return all(out.strides[1] == 1 for _, _, out in targets)


class GatherCheck:
    """The entry check a gathering tier runs on what it copied (see the module docstring)."""

    __slots__ = ("check", "copied")

    def __init__(self, check: EntryCheck, copied: CopiedCheck | None = None) -> None:
        self.check = check
        self.copied = copied

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
