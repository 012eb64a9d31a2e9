"""The ids of a source's samples: one column type for every source (:class:`IdColumn`).

A source names each sample by a user id (a manifest's ``id``, a WebDataset key, a Parquet
column) or by its position. The ids are held as one UTF-8 buffer plus ``int64`` offsets,
never as per-sample Python objects, so a source of millions of samples pickles to its
workers as two numpy arrays. The digest (:meth:`IdColumn.digest`) is what a loader's
``state_dict`` records, so that a resume over a reordered or different source is refused.

**Duplicate ids, one rule** (:meth:`IdColumn.duplicate_pair`, :func:`duplicate_message`):
two entries with one id are never both served, since their cache entries would be one.
The message names both entries (file and line, shard and member, file and row): the
later one by the error's path, line or member and id, the earlier one in the words of
:func:`duplicate_message`, so that every source says it the same way; a source
raises it as a :class:`~mmcache.errors.ManifestError` under ``on_error="raise"``; under
``"skip"`` a source that can leave an entry out keeps the first and lists the later ones
in its rejects (JSONL and LLaVA manifests, WebDataset shards, Parquet files and HF
datasets: :meth:`IdColumn.take` keeps the first rows, and the row source maps each sample
index to its row), and one that cannot tell which entry its other data means raises under
both (a COCO file: its captions refer to the image id, so either image could be the one
they describe).

Thread/process safety: read-only after construction; pickles as its two arrays.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

__all__ = ["IdColumn", "duplicate_message", "hash_ids"]


def duplicate_message(first: str) -> str:
    """The one wording of a duplicate id: ``"duplicate id (first seen at <first>)"``, where
    ``first`` names the earlier entry (``"line 3"``, ``"shard a.tar, member k.jpg"``,
    ``"a.parquet row 7"``); the error or reject carrying it names the later one (its
    path, line or member, and the id)."""
    return f"duplicate id (first seen at {first})"


class IdColumn:
    """The ids of a source's samples: a UTF-8 buffer plus ``int64`` offsets (``n + 1`` of
    them), or, with no buffer, each sample's position as a decimal string."""

    def __init__(
        self, n: int, buf: npt.NDArray[np.uint8] | None = None, offsets: Any = None
    ) -> None:
        self.n = n
        self._buf = buf
        self._off: npt.NDArray[np.int64] | None = offsets

    @classmethod
    def of_strings(cls, values: Sequence[str]) -> IdColumn:
        """From Python strings (small inputs: a COCO file, a shard table, tests)."""
        encoded = [v.encode("utf-8", "surrogatepass") for v in values]
        off = np.zeros(len(encoded) + 1, dtype=np.int64)
        off[1:] = np.cumsum([len(e) for e in encoded])
        return cls(len(encoded), np.frombuffer(b"".join(encoded), dtype=np.uint8).copy(), off)

    @classmethod
    def of_arrow(cls, array: Any) -> IdColumn:
        """From a pyarrow array (or chunked array) of any type castable to string,
        without null: its buffers copied, no per-row objects."""
        import pyarrow as pa
        import pyarrow.compute as pc

        ids = pc.cast(array, pa.large_string())
        if isinstance(ids, pa.ChunkedArray):
            ids = ids.combine_chunks()
        _, off_buf, data_buf = ids.buffers()
        off = np.frombuffer(off_buf, dtype=np.int64)[ids.offset : ids.offset + len(ids) + 1]
        start, stop = int(off[0]), int(off[-1])
        data = np.zeros(0, dtype=np.uint8)
        if data_buf is not None:
            data = np.frombuffer(data_buf, dtype=np.uint8)[start:stop].copy()
        return cls(len(ids), data, (off - start).astype(np.int64))

    def __len__(self) -> int:
        return self.n

    @property
    def buffer(self) -> npt.NDArray[np.uint8] | None:
        """The ids' UTF-8 bytes, one after the other (None: the ids are positions)."""
        return self._buf

    @property
    def offsets(self) -> npt.NDArray[np.int64] | None:
        """Where each id starts in :attr:`buffer` (``n + 1`` of them; None: positions)."""
        return self._off

    def id(self, i: int) -> str:
        """The id of sample ``i`` (not range-checked: the source checks its indices)."""
        if self._buf is None or self._off is None:
            return str(i)
        return self._buf[self._off[i] : self._off[i + 1]].tobytes().decode("utf-8", "surrogatepass")

    def ids(self, idx: npt.NDArray[np.int64]) -> list[str]:
        """The ids of ``idx`` (checked indices), in order."""
        if self._buf is None or self._off is None:
            return [str(i) for i in idx.tolist()]
        starts, stops = self._off[idx], self._off[idx + 1]
        # The batch's ids gathered into one bytes object and decoded once: when it is
        # ASCII (byte offsets are then character offsets) each id is a str slice (~0.1
        # us) instead of a UTF-8 decode of a buffer slice (~0.6 us), the warm path's cost
        # per sample. (A str of the whole column, made once, was as fast but a private
        # copy of every id in every process: O(N) per worker.)
        lengths = stops - starts
        ends = np.cumsum(lengths)
        total = int(ends[-1]) if ends.shape[0] else 0
        gather = np.repeat(starts - (ends - lengths), lengths) + np.arange(total, dtype=np.int64)
        blob = self._buf[gather].tobytes()
        if blob.isascii():
            text = blob.decode("ascii")
            return [text[a:b] for a, b in itertools.pairwise([0, *ends.tolist()])]
        view = self._buf.data
        starts, stops = starts.tolist(), stops.tolist()
        return [
            str(view[a:b], "utf-8", "surrogatepass") for a, b in zip(starts, stops, strict=True)
        ]

    def digest(self) -> str:
        """A digest of every id in order (the bytes and the lengths; positions by count)."""
        hasher = xxhash.xxh3_64()
        if self._buf is None or self._off is None:
            hasher.update(f"positions:{self.n}".encode())
        else:
            start, stop = int(self._off[0]), int(self._off[-1])
            hasher.update(np.ascontiguousarray(self._buf[start:stop]).data)
            hasher.update(np.ascontiguousarray(self._off - start, dtype="<i8").data)
        return hasher.hexdigest()

    def duplicates(self) -> list[tuple[int, int]]:
        """``(first, later)`` for every sample whose id an earlier one has (in order), with
        the first sample of that id; empty when every id is unique (positions always are).

        Found without a Python object per sample: every id hashed at once
        (:func:`hash_ids`), the hashes sorted, and only the ids of equal hashes
        compared as strings (a collision of two other ids is no duplicate)."""
        if self._buf is None or self._off is None or self.n < 2:
            return []
        hashes = hash_ids(self._buf, self._off)
        order = np.argsort(hashes, kind="stable")  # equal hashes: in sample order
        ordered = hashes[order]
        same = ordered[1:] == ordered[:-1]
        if not same.any():
            return []
        out = []
        starts = np.flatnonzero(np.diff(np.concatenate(([False], same, [False])).astype(np.int8)))
        for a, b in zip(starts[0::2].tolist(), starts[1::2].tolist(), strict=True):
            members = order[a : b + 1]  # one run of equal hashes, in sample order
            seen: dict[str, int] = {}
            for i, sid in zip(members.tolist(), self.ids(members), strict=True):
                first = seen.setdefault(sid, i)
                if first != i:
                    out.append((first, i))
        out.sort(key=lambda pair: pair[1])
        return out

    def duplicate_pair(self) -> tuple[int, int] | None:
        """The first of :meth:`duplicates`, or None when every id is unique."""
        found = self.duplicates()
        return found[0] if found else None

    def take(self, keep: npt.NDArray[np.int64]) -> IdColumn:
        """The ids of samples ``keep`` (in that order) as a new column: sample ``j`` of it
        is sample ``keep[j]`` of this one. A column of positions stays one only when
        ``keep`` is every position (its ids are the positions)."""
        keep = np.asarray(keep, dtype=np.int64)
        if self._buf is None or self._off is None:
            if not np.array_equal(keep, np.arange(self.n)):
                raise ValueError("a column of positions cannot leave samples out")
            return IdColumn(self.n)
        starts, stops = self._off[keep], self._off[keep + 1]
        lengths = stops - starts
        off = np.zeros(keep.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=off[1:])
        gather = np.repeat(starts - off[:-1], lengths) + np.arange(int(off[-1]), dtype=np.int64)
        return IdColumn(int(keep.shape[0]), self._buf[gather], off)


#: Ids hashed in groups of at most this many bytes (the hashing's scratch is 8 B a byte).
_HASH_CHUNK = 1 << 22
_HASH_MUL = np.uint64(0x100000001B3)
_HASH_LEN = np.uint64(0x9E3779B97F4A7C15)


def hash_ids(buf: npt.NDArray[np.uint8], off: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """A 64-bit hash of each id (``buf[off[i]:off[i + 1]]``), computed for all at once:
    the sum of ``(byte + 1) * M ** position`` over its bytes (wrapping, uint64), mixed
    with its length. Equal ids hash equal; other ids rarely do (callers compare those)."""
    n = off.shape[0] - 1
    out = np.zeros(n, dtype=np.uint64)
    lengths = np.diff(off)
    if n == 0 or not lengths.any():
        return out
    powers = np.cumprod(np.full(int(lengths.max()), _HASH_MUL, dtype=np.uint64))
    i = 0
    while i < n:  # ids in groups, so the scratch stays small
        j = int(np.searchsorted(off, off[i] + _HASH_CHUNK, side="right")) - 1
        j = min(max(j, i + 1), n)
        lens = lengths[i:j]
        start, stop = int(off[i]), int(off[j])
        if stop > start:
            place = np.arange(stop - start, dtype=np.int64) - np.repeat(off[i:j] - start, lens)
            terms = (buf[start:stop].astype(np.uint64) + np.uint64(1)) * powers[place]
            full = lens > 0  # reduceat over the ids that have bytes (an empty one hashes 0)
            out[i:j][full] = np.add.reduceat(terms, off[i:j][full] - start)
        i = j
    out ^= lengths.astype(np.uint64) * _HASH_LEN
    return out
