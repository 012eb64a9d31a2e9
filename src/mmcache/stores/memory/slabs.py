"""The payload bytes of a memory store: size classes, their data segments, slots and pages.

An entry's payload sits in one *slot* of its *size class*. Classes: multiples of
64 B up to 4 KiB, then 16 classes per power of two (waste < 1/16 of the entry).
Each class in use has a data segment ``mmcache-<name>-dNNN``: a slot-usage bitmap
(1 B per slot), then the *slab*, a 2-D ``uint8`` array ``[n_slots, slot_size]``.
After the crop every image sample has one size, so the common case is one slab and
a batch is gathered from one array.

The slab is sized virtually for the whole budget; tmpfs allocates pages only when
written, and the pages of freed slots are returned (``MADV_REMOVE``). Small classes
(< 4 KiB) return a page only when all slots on it are free (slots are reused lowest
first, which keeps them packed). A class's bitmap is read and written through the
mapping, so its pages are reserved in steps as the slots in use grow (``C_MARKED``,
:meth:`Slabs.reserve_slot`; see ``layout.py`` on a full ``/dev/shm``), and nothing
reads a bitmap byte beyond them; payloads are written with ``pwrite``. (A class has a
slot for every entry of its smallest size the budget holds, up to the index's
maximum: reserving that bitmap whole would cost up to 1/64 of the budget per class.)

A data segment that is missing or truncated (a same-user ``: > file`` cannot be
stopped, and kills a process that has it mapped with SIGBUS when it touches the lost
pages) makes the tier fail (:class:`Damaged`): reads miss and puts are refused in
the processes that find it; the next opener re-creates the store when nobody is
attached (or ``CacheError``), and ``reclaim_orphans`` removes it.

Reads copy straight from the mapping (:meth:`Slabs.copy_rows`). The first read of a
page by a process maps it (a minor fault per 64 KiB with the kernel's fault-around),
so the first pass of a process over new entries is slower than later ones;
shared-memory huge pages would remove that but depend on the host's tmpfs settings.
"""

from __future__ import annotations

import contextlib
import os
import threading
from bisect import bisect_left
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from mmcache.errors import CacheError

# SMALL_RANGE: byte ranges up to this long are gathered in one fancy-indexing step
# (copy_rows here, and the checked gather's copies).
from mmcache.stores.gathercheck import SMALL_RANGE, GatherCheck, Targets
from mmcache.stores.memory.access import Access
from mmcache.stores.memory.layout import C_CREATED, C_HINT, C_MARKED, C_SLOTS, C_USED, data_path
from mmcache.stores.memory.shm import PAGE_SIZE, Segment, page_round

__all__ = [
    "SMALL_CLASS_LIMIT",
    "SMALL_CLASS_STEP",
    "SMALL_RANGE",
    "Damaged",
    "Slab",
    "Slabs",
    "check_targets",
    "data_problem",
    "slot_sizes_upto",
]

#: Entries up to this size are rounded up to a multiple of SMALL_CLASS_STEP (waste < 64 B).
SMALL_CLASS_LIMIT = 4096
SMALL_CLASS_STEP = 64
#: Above SMALL_CLASS_LIMIT every power-of-two interval (2**e, 2**(e+1)] is cut into 16
#: classes of width 2**(e-4), so a slot wastes less than 1/16 of its entry's size.
_CLASSES_PER_OCTAVE = 16

#: A class's bitmap pages are reserved in steps of at least this many slots (one page),
#: and at least an eighth of those reserved so far.
BITMAP_STEP = PAGE_SIZE


def slot_sizes_upto(max_size: int) -> npt.NDArray[np.int64]:
    """Slot sizes of every size class, ascending, up to the first one >= ``max_size``.

    An entry of ``size`` bytes goes to the first class whose slot holds it:
    ``np.searchsorted(sizes, size)``. Sizes up to 4 KiB are rounded up to 64 B;
    above, to a 1/16 fraction of the enclosing power of two, so the RAM a slot
    takes beyond its payload is < 64 B for small entries and < size/16 above
    (a 150,528 B image uses a 155,648 B slot: 3.4%).

    >>> slot_sizes_upto(200).tolist()
    [64, 128, 192, 256]
    >>> int(slot_sizes_upto(150_528)[-1])
    155648
    """
    sizes = list(range(SMALL_CLASS_STEP, SMALL_CLASS_LIMIT + 1, SMALL_CLASS_STEP))
    e = SMALL_CLASS_LIMIT.bit_length() - 1
    while sizes[-1] < max_size:
        step = 1 << (e - 4)
        sizes.extend(m * step for m in range(_CLASSES_PER_OCTAVE + 1, 2 * _CLASSES_PER_OCTAVE + 1))
        e += 1
    stop = int(np.searchsorted(np.asarray(sizes), max_size, side="left")) + 1
    return np.asarray(sizes[:stop], dtype=np.int64)


class Damaged(CacheError):
    """A data segment of this store is missing, truncated or not ours: the tier failed."""


class Slab:
    """This process's mapping of one size class: the slot bitmap and the 2-D slab."""

    __slots__ = ("base", "bitmap", "rows", "seg", "slot_size")

    def __init__(self, seg: Segment, n_slots: int, slot_size: int) -> None:
        self.seg = seg
        self.slot_size = slot_size
        self.base = page_round(n_slots)
        self.bitmap: npt.NDArray[np.uint8] = np.frombuffer(seg.buf, np.uint8, count=n_slots)
        self.rows: npt.NDArray[np.uint8] = np.frombuffer(
            seg.buf, np.uint8, count=n_slots * slot_size, offset=self.base
        ).reshape(n_slots, slot_size)

    def write(self, slot: int, data: memoryview) -> None:
        """Copy ``data`` into ``slot`` (the caller owns the slot: WRITING)."""
        self.seg.write(self.base + slot * self.slot_size, data)

    @staticmethod
    def file_size(n_slots: int, slot_size: int) -> int:
        return page_round(n_slots) + page_round(n_slots * slot_size)

    def close(self) -> None:
        del self.bitmap, self.rows
        self.seg.close()


def data_problem(
    directory: str, name: str, access: Access, capacity: int, classes: npt.NDArray[np.int64]
) -> str | None:
    """Why the data segment of a created size class cannot be used, or None.

    Missing or shorter than its class needs (truncated by another program: reading
    past the end of a mapping is SIGBUS, so this is checked before any is mapped).
    Raises :class:`~mmcache.stores.memory.access.UntrustedFileError` for a segment
    another user could control.
    """
    sizes = slot_sizes_upto(capacity).tolist()
    for c in np.flatnonzero(classes[:, C_CREATED]).tolist():
        path = data_path(directory, name, c)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return f"data segment {path} is missing"
        access.check(st, path)
        want = Slab.file_size(int(classes[c, C_SLOTS]), sizes[c])
        if st.st_size < want:
            return f"data segment {path} has {st.st_size} bytes, expected {want} (truncated)"
    return None


def check_targets(n: int, targets: Sequence[tuple[int, int, npt.NDArray[np.uint8]]]) -> int:
    """Validate the ``(offset, length, out)`` destinations of a gather of ``n`` keys.

    Returns the end of the furthest range (an entry must hold that many bytes).
    """
    end = 0
    for offset, length, out in targets:
        if offset < 0 or length < 0:
            raise ValueError(f"offset and length must be >= 0, got {offset}, {length}")
        if (
            not isinstance(out, np.ndarray)
            or out.dtype != np.uint8
            or out.shape != (n, length)
            or not out.flags.writeable
        ):
            got = f"{out.dtype}{list(out.shape)}" if isinstance(out, np.ndarray) else type(out)
            raise ValueError(
                f"out must be a writeable uint8 array of shape [{n}, {length}], got {got}"
            )
        end = max(end, offset + length)
    return end


class Slabs:
    """This process's mappings of a store's size classes, over the shared size-class table.

    ``classes`` is the size-class table of the meta segment (columns ``C_*`` of
    ``layout.py``: created, slots, used, lowest possibly free slot). A class is mapped
    on first use; callers hold the store lock (shared to read, exclusive to create a
    class, allocate or free a slot), and mapping takes a thread lock of its own, as
    readers share the store lock.
    """

    __slots__ = ("_access", "_directory", "_lock", "_mapped", "classes", "name", "sizes",
                 "sizes_list")  # fmt: skip

    def __init__(
        self,
        classes: npt.NDArray[np.int64],
        capacity: int,
        *,
        directory: str,
        name: str,
        access: Access,
    ) -> None:
        self.classes = classes
        self.name = name
        self._directory = directory
        self._access = access
        self.sizes = slot_sizes_upto(capacity)
        self.sizes_list: list[int] = self.sizes.tolist()
        if len(self.sizes_list) != classes.shape[0]:
            raise CacheError(f"memory store {name!r}: size-class table mismatch")
        self._mapped: dict[int, Slab] = {}
        self._lock = threading.Lock()

    def class_of(self, size: int) -> int:
        """The size class of an entry of ``size`` bytes."""
        return bisect_left(self.sizes_list, size)

    def created(self) -> list[int]:
        """The classes whose data segment was created."""
        created: list[int] = np.flatnonzero(self.classes[:, C_CREATED]).tolist()
        return created

    def get(self, cls: int, *, create: bool = False) -> Slab:
        """This process's mapping of size class ``cls`` (created if ``create``; needs EX).

        Raises :class:`Damaged` if its data segment is missing, truncated or not ours.
        """
        slab = self._mapped.get(cls)
        if slab is not None:
            return slab
        with self._lock:
            slab = self._mapped.get(cls)
            if slab is not None:
                return slab
            n_slots = int(self.classes[cls, C_SLOTS])
            slot_size = self.sizes_list[cls]
            size = Slab.file_size(n_slots, slot_size)
            path = data_path(self._directory, self.name, cls)
            if int(self.classes[cls, C_CREATED]):
                try:
                    seg = Segment.open(path, size, access=self._access)
                except FileNotFoundError:
                    raise Damaged(
                        f"memory store {self.name!r}: data segment {path} is missing"
                        " (removed by hand?); remove the store (mmcache gc) and retry"
                    ) from None
                except CacheError as exc:  # truncated, or not ours
                    raise Damaged(str(exc)) from exc
            elif create:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)  # left by a creator that died before flagging it
                # The bitmap is read and written through the mapping: reserve its first
                # step now (1 B per slot), more in reserve_slot; payloads use pwrite.
                first = min(n_slots, BITMAP_STEP)
                seg = Segment.create(path, size, access=self._access, reserve=[(0, first)])
                self.classes[cls, C_MARKED] = first
                self.classes[cls, C_CREATED] = 1
            else:
                raise CacheError(f"memory store {self.name!r}: size class {cls} missing")
            slab = Slab(seg, n_slots, slot_size)
            self._mapped[cls] = slab
            return slab

    def marked(self, cls: int) -> int:
        """Slots of class ``cls`` whose bitmap bytes may be touched (their pages exist)."""
        row = self.classes[cls]
        return min(max(int(row[C_MARKED]), 0), int(row[C_SLOTS]))

    def reserve_slot(self, cls: int) -> None:
        """Make sure :meth:`alloc` finds a free slot of ``cls`` among the marked ones:
        allocate the next step of its bitmap if they are all used. Caller holds EX.

        Raises ``OSError`` (``ENOSPC``) when /dev/shm has no room.
        """
        slab = self.get(cls, create=True)
        row = self.classes[cls]
        have, n = self.marked(cls), int(row[C_SLOTS])
        if int(row[C_USED]) < have or have >= n:
            return
        want = min(n, have + max(BITMAP_STEP, have // 8))
        slab.seg.reserve(have, want - have)
        row[C_MARKED] = want

    def alloc(self, cls: int) -> tuple[Slab, int]:
        """Take the lowest free slot of class ``cls`` (:meth:`reserve_slot` first). EX held."""
        slab = self.get(cls, create=True)
        row = self.classes[cls]
        bitmap = slab.bitmap
        n = self.marked(cls)
        pos = int(row[C_HINT])
        while pos < n:
            chunk = bitmap[pos : min(pos + 4096, n)]  # never past the marked slots
            free = np.flatnonzero(chunk == 0)
            if free.shape[0]:
                slot = pos + int(free[0])
                bitmap[slot] = 1
                row[C_USED] += 1
                row[C_HINT] = slot + 1
                return slab, slot
            pos += chunk.shape[0]
        raise CacheError(  # the budget arithmetic makes this unreachable; never corrupt instead
            f"memory store {self.name!r}: no free slot in size class {cls}"
        )

    def free(self, cls: int, slot: int) -> None:
        """Mark ``slot`` free (its pages stay until :meth:`release_pages`). Caller holds EX."""
        self.get(cls).bitmap[slot] = 0
        row = self.classes[cls]
        row[C_USED] -= 1
        row[C_HINT] = min(int(row[C_HINT]), slot)

    def release_pages(self, cls: int, slot: int) -> None:
        """Return the pages of a free slot that no held slot shares. Caller holds EX."""
        slab = self.get(cls)
        ss = slab.slot_size
        bitmap = slab.bitmap
        if bitmap[slot]:
            return  # reused in the same critical section
        start, stop = slot * ss, (slot + 1) * ss
        if start % PAGE_SIZE:
            page = start // PAGE_SIZE * PAGE_SIZE
            below = bitmap[page // ss : slot]
            start = page if not below.any() else page + PAGE_SIZE
        if stop % PAGE_SIZE:
            page = stop // PAGE_SIZE * PAGE_SIZE
            above = bitmap[slot + 1 : min(self.marked(cls), -(-(page + PAGE_SIZE) // ss))]
            stop = page + PAGE_SIZE if not above.any() else page
        if stop > start:
            slab.seg.punch(slab.base + start, stop - start)

    def release_all(self, released: Iterable[tuple[int, int]]) -> None:
        """:meth:`release_pages` of every ``(class, slot)`` freed in this section."""
        for cls, slot in released:
            self.release_pages(cls, slot)

    def copy_rows(
        self,
        out: npt.NDArray[np.uint8],
        idx: npt.NDArray[np.int64],
        cls: npt.NDArray[np.int16],
        slots: npt.NDArray[np.int32],
        *,
        start: int,
        stop: int,
    ) -> None:
        """``out[idx[j]] = slab(cls[j])[slots[j], start:stop]``, grouped by size class.

        The hot path of every gather (caller holds the store lock, shared). A short
        range (a header and the token ids: up to ``SMALL_RANGE`` bytes) is gathered
        with one fancy-indexing step (its temporary is small, and one Python-level row
        copy per sample costs more). A long one (the image) takes one numpy row copy
        (a memcpy) per sample: this runs near the speed of a plain contiguous copy of
        the same bytes, while the "vectorised" alternatives are slower: ``np.take``
        along axis 0 (it copies the whole slab when the column range is not the full
        row, and is slow even when it is) and fancy indexing ``slab[rows, a:b]`` (a
        temporary, then a second copy).
        """
        if (cls == cls[0]).all():
            groups: list[tuple[int, list[int], list[int]]] = [
                (int(cls[0]), idx.tolist(), slots.tolist())
            ]
        else:
            groups = [
                (int(c), idx[cls == c].tolist(), slots[cls == c].tolist()) for c in np.unique(cls)
            ]
        small = stop - start <= SMALL_RANGE
        for c, rows_out, rows_in in groups:
            slab = self.get(c).rows
            if small:
                out[rows_out] = slab[rows_in, start:stop]  # one gather: no per-row Python
                continue
            for i, r in zip(rows_out, rows_in, strict=True):
                out[i] = slab[r, start:stop]

    def copy_checked(
        self,
        check: GatherCheck,
        out_rows: npt.NDArray[np.int64],
        cls: npt.NDArray[np.int16],
        slots: npt.NDArray[np.int32],
        sizes: npt.NDArray[np.int64],
        *,
        targets: Targets,
    ) -> npt.NDArray[np.bool_]:
        """Copy the entries at ``slots`` of classes ``cls`` (``sizes`` bytes each) into rows
        ``out_rows`` of the targets and check each (:mod:`mmcache.stores.gathercheck`):
        :meth:`GatherCheck.copy_checked_rows` per group of entries of one size in one
        class (a batch of one layout is one group), else entry by entry. Per entry,
        whether it failed its read check. Caller holds the store lock (shared)."""
        if (cls == cls[0]).all() and (sizes == sizes[0]).all():
            groups = [np.arange(len(cls))]
        else:
            pairs = np.stack([cls.astype(np.int64), sizes.astype(np.int64)], axis=1)
            _, inverse = np.unique(pairs, axis=0, return_inverse=True)
            groups = [np.flatnonzero(inverse.ravel() == g) for g in range(int(inverse.max()) + 1)]
        bad = np.zeros(len(cls), dtype=bool)
        for g in groups:
            first = int(g[0])
            slab, size = self.get(int(cls[first])).rows, int(sizes[first])
            # The index keeps slots as int32 (``index.ENTRY_COLUMNS``); the check takes int64.
            rows = slots[g].astype(np.int64)
            got = check.copy_checked_rows(slab, out_rows[g], rows, size, targets)
            if got is None:  # a layout of ranges that form does not take: entry by entry
                entries = [slab[slot, :size] for slot in slots[g].tolist()]
                got = check.copy_checked(out_rows[g].tolist(), entries, targets)
            bad[g] = got
        return bad

    def after_fork(self) -> None:
        """In a fork child: a fresh thread lock (the parent's may have been held)."""
        self._lock = threading.Lock()

    def close(self) -> None:
        """Unmap every class of this process."""
        with self._lock:
            mapped, self._mapped = self._mapped, {}
        for slab in mapped.values():
            slab.close()
