"""``pack=PackSpec(max_tokens=4096)``: several samples per row, planned from the lengths only.

The plan of epoch ``e`` is a pure function of ``(seed, e)`` and the source's token
counts (:mod:`mmcache.loader.lengths`), so it is the same on every rank, in every
worker and after a resume, and nothing is decoded to make it:

1. the epoch's whole-dataset permutation (:meth:`EpochSampler.permutation`), less
   the samples of length 0 (refused by the source), is cut into windows of
   ``PackSpec.window`` samples;
2. within a window, first-fit decreasing: samples longest first (ties in the
   permutation's order), each into the first open pack it fits in (total tokens
   ``<= max_tokens``), or a new one. A pack never holds a sample split in two; a
   sample longer than ``max_tokens`` is refused when the loader is made (a
   :class:`~mmcache.errors.SampleError` naming it);
3. the packs of all windows are shuffled (seeded by ``(seed, epoch)``) and shared
   out between ranks like batches (:func:`~mmcache.loader.grouping.split_by_rank`):
   every rank the same number of packs, by construction.

Each pack is one batch; :class:`~mmcache.loader.padding.PackHook` concatenates its
samples and adds ``cu_seqlens`` and ``position_ids``. Since a batch is just a list of
sample indices, the cache, the miss workers and the guessed warm epochs handle packs
exactly as they handle any other batch.

Thread/process safety: immutable (frozen dataclasses over read-only arrays).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mmcache.checks import check_int
from mmcache.loader.grouping import split_by_rank
from mmcache.loader.stream import BatchOrder

__all__ = ["PackSpec", "PackedOrder", "first_fit_decreasing"]

_SHUFFLE_SALT = 0x7061636B  # "pack"


@dataclass(frozen=True)
class PackSpec:
    """How to pack samples: at most ``max_tokens`` tokens per pack, planned over windows
    of ``window`` consecutive samples of the epoch's order (larger: fuller packs, less
    random; the whole epoch with ``window=None``).

    >>> PackSpec(max_tokens=4096).window
    1024
    """

    max_tokens: int = 4096
    window: int | None = 1024

    def __post_init__(self) -> None:
        check_int("PackSpec.max_tokens", self.max_tokens, minimum=1)
        if self.window is not None:
            check_int("PackSpec.window", self.window, minimum=1)

    def describe(self) -> str:
        """What goes into the loader's ``state_dict`` (a resume must pack the same)."""
        return f"pack(max_tokens={self.max_tokens},window={self.window})"


def first_fit_decreasing(
    indices: np.ndarray, lengths: np.ndarray, max_tokens: int
) -> list[np.ndarray]:
    """Packs of ``indices`` (each ``lengths[i] <= max_tokens``): longest first, each into
    the first pack with room for it. Packs in the order they were opened; samples in
    each in the order they were put in."""
    order = indices[np.argsort(-lengths[indices], kind="stable")]
    room = np.empty(len(order), dtype=np.int64)  # room left in each open pack
    members: list[list[int]] = []
    for i in order.tolist():
        need = int(lengths[i])
        fits = room[: len(members)] >= need
        j = int(fits.argmax()) if members else 0
        if not members or not fits[j]:
            j = len(members)
            members.append([])
            room[j] = max_tokens
        members[j].append(i)
        room[j] -= need
    return [np.asarray(m, dtype=np.int64) for m in members]


@dataclass(frozen=True, eq=False)
class PackedOrder(BatchOrder):
    """:class:`BatchOrder` whose batches are packs (see the module docstring)."""

    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    spec: PackSpec = field(default_factory=PackSpec)

    def batches(self, epoch: int) -> list[np.ndarray]:
        s = self.sampler
        perm = s.permutation(epoch)
        perm = perm[self.lengths[perm] > 0]  # 0: a sample the source refuses
        window = self.spec.window or max(len(perm), 1)
        packs: list[np.ndarray] = []
        for a in range(0, len(perm), window):
            packs.extend(
                first_fit_decreasing(perm[a : a + window], self.lengths, self.spec.max_tokens)
            )
        if s.shuffle and packs:
            order = _rng(s.seed, epoch).permutation(len(packs)).tolist()
            packs = [packs[k] for k in order]
        if not packs:
            return []
        return split_by_rank(packs, rank=s.rank, world_size=s.world_size, drop_last=s.drop_last)


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([seed, epoch, _SHUFFLE_SALT]))
    )
