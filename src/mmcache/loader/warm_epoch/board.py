"""``FileCheckBoard``: per-sample ``stat`` results the stat prefetcher publishes for the loader.

In a guessed epoch (see :mod:`mmcache.loader.warm_epoch`) every sample's cache
key is already known in the training process; what each epoch must still
establish is that no image file changed since that key was made (a ``stat``
per file, after the epoch began). The loader's
:class:`~mmcache.loader.warm_epoch.prefetch.StatPrefetcher` does those
``stat`` calls in the background, in the epoch's order, and publishes each
result here, in shared memory: the training process reads them with one
vectorised comparison per batch, with no message to wait for (a result sent
through torch's worker queues arrives later than the whole check takes).

One ``uint64`` per sample: a 64-bit mix of the file's stamp (every field of
:data:`mmcache.keys.STAT_FIELDS`: size, mtime, ctime, inode, the same fields
the keys are made of) and the *check round* of the ``stat`` (:func:`seal`): a
number the training process gives each guessed epoch, never reused (an epoch
number would be: an epoch run again after going back must not pass on the old
run's results). A single aligned 64-bit store is atomic, so a reader sees a
whole old value or a whole new one, and a value only matches what the reader
expects when the file was ``stat``-ed in that round and had the expected
stamp. Zero means "never published".

A board made with ``key_stamps`` also carries *published keys*, for an epoch
whose keys the training process does not know (a new process's first epoch
over a cache another run filled, see :mod:`mmcache.loader.warm_epoch`): the
prefetcher computes each sample's cache key from the stamps it just took and
publishes key, stamps and a seal of both and the round (:meth:`publish_keys`).
The seal is written last and the reader checks it against the very key and
stamps it copied (:meth:`published`), twice read: a row copied while being
rewritten, or seen before its key on a weakly ordered CPU, fails the check and
is never served; only whole rows published in the round asked for pass.

Thread/process safety: :meth:`publish` and :meth:`publish_keys` from any process
(the prefetcher), :meth:`verified` and :meth:`published` from the training
process; created before the workers start (fork) or sent to them at start
(spawn), like the other ``multiprocessing`` shared objects.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["FileCheckBoard", "seal"]

# Odd 64-bit multipliers (from splitmix64, murmur3 and the golden ratio). Each
# step of the mix, z = (z ^ word) * K, then z ^= z >> 31, is a bijection of the
# word for a given z, so a change of any one field (or of the round) always
# changes the combined word; chaining the steps (rather than xor-ing one product
# per field) keeps changes of two fields from cancelling out. The value kept
# drops the lowest bit, to stay non-zero.
_K_FIELDS = (
    np.uint64(0x9E3779B97F4A7C15),
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0xFF51AFD7ED558CCD),
    np.uint64(0xC4CEB9FE1A85EC53),
    np.uint64(0x2545F4914F6CDD1D),
    np.uint64(0x9FB21C651E98DF25),
)
_K_ROUND = 0x94D049BB133111EB
_K_MIX = np.uint64(0xD6E8FEB86659FD93)
_MASK = (1 << 64) - 1


def seal(stamps: npt.NDArray[np.int64], round_: int) -> npt.NDArray[np.uint64]:
    """One non-zero 64-bit value per row of ``stamps`` (``int64 [n, k]``, k <= 6: the
    :meth:`~mmcache.sources.base.SampleSource.stamps` rows of a ``StampKind.FILE`` source,
    and for :func:`seal_keyed` the two words of the key after them) for check round
    ``round_``;
    equal values mean equal stamps in the same round, but for a 2**-63 chance. A
    few numpy operations per field: the training process checks every batch with it."""
    arr = np.ascontiguousarray(stamps, dtype=np.int64)
    s = arr.view(np.uint64).reshape(arr.shape[0], -1)
    if s.shape[1] > len(_K_FIELDS):
        raise ValueError(f"a stamp has at most {len(_K_FIELDS)} fields, got {s.shape[1]}")
    with np.errstate(over="ignore"):
        z = np.full(s.shape[0], (round_ * _K_ROUND) & _MASK, dtype=np.uint64)
        for c in range(s.shape[1]):
            z ^= s[:, c]
            z *= _K_FIELDS[c]
            z ^= z >> np.uint64(31)
        z *= _K_MIX
        z ^= z >> np.uint64(29)
    z |= np.uint64(1)  # never zero: zero is "never published"
    out: npt.NDArray[np.uint64] = z
    return out


def seal_keyed(
    keys: npt.NDArray[np.uint8], stamps: npt.NDArray[np.int64], round_: int
) -> npt.NDArray[np.uint64]:
    """:func:`seal` of each row's stamps followed by its 16-byte key (``uint8 [n, 16]``)."""
    words = np.ascontiguousarray(keys, dtype=np.uint8).view(np.int64).reshape(len(keys), 2)
    return seal(np.concatenate([np.asarray(stamps, dtype=np.int64), words], axis=1), round_)


class FileCheckBoard:
    """The shared ``stat`` results of ``n`` samples (see the module docstring).

    Args:
        n: samples (dataset rows).
        context: the multiprocessing context (or its name) of the workers.
        key_stamps: the words of a stamp row when the board carries published keys
            too (48 bytes more per sample, shared), 0 when it does not.
    """

    def __init__(self, n: int, context: Any = None, *, key_stamps: int = 0) -> None:
        if isinstance(context, str):
            context = multiprocessing.get_context(context)
        ctx = context if context is not None else multiprocessing.get_context()
        self._n = n
        self._raw = ctx.RawArray("Q", max(n, 1))
        self._values: npt.NDArray[np.uint64] | None = None
        self._words = key_stamps
        # Published keys: a seal, the key and the stamps of each sample (see the module).
        self._keyed_raw = ctx.RawArray("Q", max(n, 1)) if key_stamps else None
        self._keys_raw = ctx.RawArray("B", 16 * max(n, 1)) if key_stamps else None
        self._stamps_raw = ctx.RawArray("q", key_stamps * max(n, 1)) if key_stamps else None
        self._keyed: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_values"] = None  # views of this process's mapping: made again on arrival
        state["_keyed"] = None
        return state

    @property
    def carries_keys(self) -> bool:
        return self._keyed_raw is not None

    def _key_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seals ``uint64 [n]``, keys ``uint8 [n, 16]``, stamps ``int64 [n, words]``)."""
        if self._keyed is None:
            if self._keyed_raw is None or self._keys_raw is None or self._stamps_raw is None:
                raise RuntimeError("this board carries no keys (made without key_stamps)")
            n = self._n
            self._keyed = (
                np.frombuffer(self._keyed_raw, dtype=np.uint64, count=n),
                np.frombuffer(self._keys_raw, dtype=np.uint8, count=16 * n).reshape(n, 16),
                np.frombuffer(self._stamps_raw, dtype=np.int64, count=self._words * n).reshape(
                    n, self._words
                ),
            )
        return self._keyed

    def publish_keys(
        self,
        indices: npt.NDArray[np.int64],
        keys: npt.NDArray[np.uint8],
        stamps: npt.NDArray[np.int64],
        round_: int,
    ) -> None:
        """Record that ``indices`` had ``keys``, made from ``stamps`` ``stat``-ed in
        ``round_``: key and stamps first, the seal of all three last."""
        seals, key_rows, stamp_rows = self._key_arrays()
        key_rows[indices] = keys
        stamp_rows[indices] = stamps
        seals[indices] = seal_keyed(keys, stamps, round_)

    def published(
        self, indices: npt.NDArray[np.int64], round_: int
    ) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]] | None:
        """The keys and stamps of ``indices`` published in ``round_``, or None unless
        every row was, whole (its seal read before and after copying it matches it)."""
        seals, key_rows, stamp_rows = self._key_arrays()
        before = seals[indices]
        if not before.all():  # a row never published (the common early case)
            return None
        keys, stamps = key_rows[indices], stamp_rows[indices]  # (fancy indexing: copies)
        after = seals[indices]
        if not (
            np.array_equal(before, after) and (before == seal_keyed(keys, stamps, round_)).all()
        ):
            return None
        return keys, stamps

    @property
    def values(self) -> npt.NDArray[np.uint64]:
        if self._values is None:
            self._values = np.frombuffer(self._raw, dtype=np.uint64, count=self._n)
        return self._values

    def publish(
        self, indices: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64], round_: int
    ) -> None:
        """Record that ``indices`` had ``stamps`` when ``stat``-ed in ``round_``."""
        self.values[indices] = seal(stamps, round_)

    def verified(
        self, indices: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64], round_: int
    ) -> npt.NDArray[np.bool_]:
        """Per row: published in ``round_`` with exactly ``stamps``."""
        got = self.values[indices]
        result: npt.NDArray[np.bool_] = got == seal(stamps, round_)
        return result
