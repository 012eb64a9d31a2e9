"""Pure-numpy pieces of the memory tier's index: size classes and the hash table.

Nothing here touches files or locks; every function works on arrays the
caller owns (views into shared memory, under the caller's lock), so it is
easy to test alone.

The hash table is open addressing with linear probing over ``int32`` cells:
``0`` is a free cell, ``-1`` a tombstone (a deleted cell that probes must walk
past), and ``v > 0`` points to entry ``v - 1``. Zero meaning "free" lets a new
table be a zero-filled (sparse, untouched) tmpfs file. Keys are 128-bit
digests stored as two ``uint64`` words per entry; the home cell is a
multiplicative hash of both words, so keys that are not uniform (small
integers, sequential ids) still spread.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = [
    "CELL_FREE",
    "CELL_TOMBSTONE",
    "SMALL_CLASS_LIMIT",
    "SMALL_CLASS_STEP",
    "home_cell",
    "home_cells",
    "lookup_many",
    "rebuild_table",
    "slot_sizes_upto",
]

CELL_FREE = 0
CELL_TOMBSTONE = -1

_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: Fibonacci hashing
_MASK64 = (1 << 64) - 1
_MIX_U64 = np.uint64(_MIX)

#: Entries up to this size are rounded up to a multiple of SMALL_CLASS_STEP (waste < 64 B).
SMALL_CLASS_LIMIT = 4096
SMALL_CLASS_STEP = 64
#: Above SMALL_CLASS_LIMIT every power-of-two interval (2**e, 2**(e+1)] is cut into 16
#: classes of width 2**(e-4), so a slot wastes less than 1/16 of its entry's size.
_CLASSES_PER_OCTAVE = 16


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


def home_cell(k0: int, k1: int, shift: int) -> int:
    """Home cell of one key (two 64-bit words) in a table of ``2**(64-shift)`` cells."""
    return (((k0 ^ k1) * _MIX) & _MASK64) >> shift


def home_cells(keys: npt.NDArray[np.uint64], shift: int) -> npt.NDArray[np.int64]:
    """Vectorised :func:`home_cell` over ``keys`` of shape ``[n, 2]``."""
    mixed = (keys[:, 0] ^ keys[:, 1]) * _MIX_U64  # uint64 arithmetic wraps, as intended
    cells: npt.NDArray[np.int64] = (mixed >> np.uint64(shift)).astype(np.int64)
    return cells


def lookup_many(
    table: npt.NDArray[np.int32],
    entry_keys: npt.NDArray[np.uint64],
    keys: npt.NDArray[np.uint64],
    shift: int,
) -> npt.NDArray[np.int64]:
    """Entry number of each of ``keys`` (``[n, 2]`` uint64), or -1 where absent.

    All keys probe in lock step: the first round is a handful of numpy
    operations over the whole batch and, with the load kept at or below 3/4
    (tombstones included), ends the search of almost every key (a match or a
    free cell); the few that must walk on do so in further rounds over just
    themselves. Caller holds the store lock (shared is enough).
    """
    n = keys.shape[0]
    if n == 0:
        return np.full(0, -1, dtype=np.int64)
    mask = table.shape[0] - 1
    k0 = entry_keys[:, 0]
    k1 = entry_keys[:, 1]
    q0 = keys[:, 0]
    q1 = keys[:, 1]
    pos = home_cells(keys, shift)
    cell = table[pos]
    entry = np.maximum(cell - 1, 0)
    match = (cell > 0) & (k0[entry] == q0) & (k1[entry] == q1)
    out = np.where(match, entry, -1).astype(np.int64)
    active = np.flatnonzero(~match & (cell != CELL_FREE))
    for _ in range(mask):
        if active.shape[0] == 0:
            break
        pos = (pos[active] + 1) & mask if pos.shape[0] == n else (pos + 1) & mask
        cell = table[pos]
        entry = np.maximum(cell - 1, 0)
        match = (cell > 0) & (k0[entry] == q0[active]) & (k1[entry] == q1[active])
        out[active[match]] = entry[match]
        go_on = ~match & (cell != CELL_FREE)
        active = active[go_on]
        pos = pos[go_on]
    return out


def rebuild_table(
    table: npt.NDArray[np.int32],
    entry_keys: npt.NDArray[np.uint64],
    entries: npt.NDArray[np.int64],
    shift: int,
) -> None:
    """Clear ``table`` and insert ``entries`` (entry numbers; keys must be distinct).

    Vectorised: in each round every pending entry tries its current cell; of
    those that find it free, one per cell wins and the others move on one
    cell. So an entry only moves past occupied cells, which is the linear
    probing invariant lookups rely on. Caller holds the store lock exclusively.
    """
    table[:] = CELL_FREE
    if entries.shape[0] == 0:
        return
    mask = table.shape[0] - 1
    pending = entries.astype(np.int64)
    pos = home_cells(entry_keys[pending], shift)
    while pending.shape[0]:
        free = table[pos] == CELL_FREE
        cand_pos = pos[free]
        _, first = np.unique(cand_pos, return_index=True)
        winners = np.flatnonzero(free)[first]
        table[pos[winners]] = (pending[winners] + 1).astype(np.int32)
        keep = np.ones(pending.shape[0], dtype=bool)
        keep[winners] = False
        pending = pending[keep]
        pos = (pos[keep] + 1) & mask
