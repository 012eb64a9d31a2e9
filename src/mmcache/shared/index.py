"""The merged index of a share in one process: every committed pack's entries as columns.

A node reads a share of 10^7-10^8 entries, so the index it keeps is columns of fixed
dtypes (44 bytes an entry: the key as two uint64 words, the pack, offset, size,
creation time and cost, and whether this handle hides the entry), never a dict or a
Python object per entry. The rows are sorted by the key's first word; a batch of keys
is found with two ``searchsorted`` calls (the second word confirms, and a tie of first
words, one in 10^11 at 10^8 entries, is scanned).

A key is listed once: the copy of the pack added last. Packs are added in the order of
their names (the wall clock of their making), so the newest copy wins, and this
process's own packs are added as they are committed: a value put again replaces the
old one, and an entry produced again after it was found damaged is found again. (Two
writers publish the same key when two nodes produce the same sample at once; equal
keys are equal inputs and pipelines, so either copy serves.)

Adding packs merges their rows in (a ``searchsorted`` and an insert per column: a
copy of the columns, once per refresh that finds new packs); packs gone from the share
(``mmcache gc --shared``) are dropped.

Not thread-safe: :class:`~mmcache.shared.tier.SharedTier` holds its lock around every call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from mmcache.keys import KEY_SIZE
from mmcache.shared.layout import IndexArrays

__all__ = ["MergedIndex", "Rows", "split_keys"]

#: The index's columns and their dtypes, in one place (``_take``, ``_insert``, ``_empty``).
_COLUMNS: dict[str, str] = {
    "hi": "u8",
    "lo": "u8",
    "pack": "u4",
    "offset": "u8",
    "size": "u4",
    "ctime": "f8",
    "cost": "f4",
    "hidden": "?",
}


def split_keys(keys: Sequence[bytes] | npt.NDArray[np.uint8]) -> tuple[np.ndarray, np.ndarray]:
    """16-byte keys (``bytes`` each, or ``uint8 [n, 16]``) as their two big-endian uint64
    words, as native ``uint64`` arrays: the order of the words is the order of the keys."""
    if isinstance(keys, np.ndarray):
        arr = np.ascontiguousarray(keys, dtype=np.uint8).reshape(-1, KEY_SIZE)
    else:
        arr = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, KEY_SIZE)
    words = arr.view(">u8").reshape(-1, 2).astype(np.uint64)
    return words[:, 0].copy(), words[:, 1].copy()


class Rows:
    """Columns of entries (see ``_COLUMNS``), all of one length."""

    def __init__(self, **columns: np.ndarray) -> None:
        self.hi: np.ndarray = columns["hi"]
        self.lo: np.ndarray = columns["lo"]
        self.pack: np.ndarray = columns["pack"]
        self.offset: np.ndarray = columns["offset"]
        self.size: np.ndarray = columns["size"]
        self.ctime: np.ndarray = columns["ctime"]
        self.cost: np.ndarray = columns["cost"]
        self.hidden: np.ndarray = columns["hidden"]

    @classmethod
    def empty(cls) -> Rows:
        return cls(**{name: np.zeros(0, dtype) for name, dtype in _COLUMNS.items()})

    @classmethod
    def of_pack(cls, slot: int, arrays: IndexArrays) -> Rows:
        hi, lo = split_keys(arrays.keys)
        n = len(arrays)
        return cls(
            hi=hi,
            lo=lo,
            pack=np.full(n, slot, np.uint32),
            offset=arrays.offset,
            size=arrays.size,
            ctime=arrays.ctime,
            cost=arrays.cost,
            hidden=np.zeros(n, bool),
        )

    def __len__(self) -> int:
        return len(self.hi)

    def columns(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in _COLUMNS}

    def take(self, where: np.ndarray) -> Rows:
        return Rows(**{name: col[where] for name, col in self.columns().items()})

    def key(self, row: int) -> bytes:
        """The 16-byte key of ``row``."""
        return int(self.hi[row]).to_bytes(8, "big") + int(self.lo[row]).to_bytes(8, "big")


class MergedIndex:
    """Every loaded pack's entries, one row per key, sorted by the key's first word.

    ``packs`` names the pack of each ``pack`` slot; a slot is never reused, so rows of a
    dropped pack can never point at another one.
    """

    def __init__(self) -> None:
        self.rows = Rows.empty()
        self.packs: list[str] = []
        self._slots: dict[str, int] = {}
        self._dropped: set[int] = set()

    def __len__(self) -> int:
        return len(self.rows)

    def loaded(self) -> set[str]:
        """The packs whose rows are in (dropped ones excluded)."""
        return {p for p, s in self._slots.items() if s not in self._dropped}

    def add(self, packs: Sequence[tuple[str, IndexArrays]]) -> int:
        """Merge the entries of ``packs`` (name and index, oldest first: a later copy of a
        key replaces an earlier one); return the rows added."""
        parts = []
        for name, arrays in packs:
            if name in self._slots:
                continue
            slot = len(self.packs)
            self.packs.append(name)
            self._slots[name] = slot
            if len(arrays):
                parts.append(Rows.of_pack(slot, arrays))
        if not parts:
            return 0
        new = Rows(**{c: np.concatenate([p.columns()[c] for p in parts]) for c in _COLUMNS})
        # One row per key among the new ones: the last in the given order (a stable sort).
        order = np.lexsort((new.lo, new.hi))
        new = new.take(order)
        last = np.ones(len(new), bool)
        last[:-1] = (new.hi[1:] != new.hi[:-1]) | (new.lo[1:] != new.lo[:-1])
        new = new.take(np.flatnonzero(last))
        # Keys this index holds already: the new copy replaces the old one.
        found = self.find(new.hi, new.lo, visible=False)
        if (found >= 0).any():
            self._drop_rows(found[found >= 0])
        at = np.searchsorted(self.rows.hi, new.hi, side="left")
        self.rows = Rows(
            **{c: np.insert(col, at, getattr(new, c)) for c, col in self.rows.columns().items()}
        )
        return len(new)

    def drop_packs(self, names: Sequence[str]) -> int:
        """Drop the rows of the packs ``names`` (gone from the share); return how many."""
        slots = [self._slots[n] for n in names if n in self._slots]
        slots = [s for s in slots if s not in self._dropped]
        if not slots:
            return 0
        self._dropped.update(slots)
        gone = np.isin(self.rows.pack, np.asarray(slots, np.uint32))
        self._drop_rows(np.flatnonzero(gone))
        return int(gone.sum())

    def _drop_rows(self, rows: np.ndarray) -> None:
        keep = np.ones(len(self.rows), bool)
        keep[rows] = False
        self.rows = self.rows.take(np.flatnonzero(keep))

    def find(self, hi: np.ndarray, lo: np.ndarray, *, visible: bool = True) -> np.ndarray:
        """The row of each key (its two words), ``-1`` where absent (or, with ``visible``,
        hidden by this handle); ``int64 [n]``."""
        rows = self.rows
        left = np.searchsorted(rows.hi, hi, side="left")
        right = np.searchsorted(rows.hi, hi, side="right")
        out = np.full(len(hi), -1, np.int64)
        one = right - left == 1
        cand = left[one]
        ok = rows.lo[cand] == lo[one]
        if visible:
            ok &= ~rows.hidden[cand]
        out[np.flatnonzero(one)[ok]] = cand[ok]
        for i in np.flatnonzero(right - left > 1):  # first words tie: scan them
            for r in range(int(left[i]), int(right[i])):
                if rows.lo[r] == lo[i] and not (visible and rows.hidden[r]):
                    out[i] = r
                    break
        return out

    def hide(self, row: int) -> None:
        """Hide ``row`` from this handle (damaged, deleted, expired here)."""
        self.rows.hidden[row] = True

    def visible(self) -> np.ndarray:
        """The rows not hidden (``int64``)."""
        return np.flatnonzero(~self.rows.hidden)

    def keys(self) -> Iterator[bytes]:
        """The visible keys (a snapshot)."""
        rows = self.rows
        for r in self.visible():
            yield rows.key(int(r))

    def nbytes(self) -> int:
        """The bytes of the visible entries."""
        rows = self.rows
        return int(rows.size[~rows.hidden].sum(dtype=np.uint64))

    def count(self) -> int:
        """The visible entries."""
        return int((~self.rows.hidden).sum())
