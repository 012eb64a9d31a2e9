"""Deterministic epoch orders: a pure function of (seed, epoch, dataset size, rank, world).

The order of epoch ``e`` never depends on the number of workers, on batch
timing or on which samples hit the cache, so the same seed gives the same
batches with the cache on, off, cold or warm, and a resumed run continues
exactly where it stopped. Knowing the whole future order is also what lets
the loader schedule misses ahead in exact order.

Ranks take disjoint parts like ``torch.utils.data.DistributedSampler``: the
permutation is padded by repeating its first elements up to a multiple of
``world_size`` (``drop_last=False``; every sample is seen, a few twice), or
cut down to a multiple (``drop_last=True``; a few are not seen this epoch),
then rank ``r`` takes positions ``r, r + world, r + 2*world, ...``. This
``drop_last`` is DistributedSampler's (the loader's ``Distributed(drop_last=...)``),
not the DataLoader's, which drops each rank's last partial batch.

Elastic resume (:meth:`EpochSampler.span_indices`): after ``p`` batches of
``b`` per rank, the ranks together have consumed positions ``[0, p*b*world)``
of the epoch's order, a prefix. What remains, ``permutation(e)[start:stop]``
(``stop``: :meth:`EpochSampler.epoch_stop`, the padding left out), is split over
any other world size the same way: padded by repeating its own first elements
(``drop_last=False``) or cut (``drop_last=True``) to a multiple of the new
world size, so every rank has the same number of samples.

>>> EpochSampler(5, seed=0, shuffle=False).indices(0).tolist()
[0, 1, 2, 3, 4]
>>> a = EpochSampler(10, seed=3, rank=0, world_size=2).indices(1)
>>> b = EpochSampler(10, seed=3, rank=1, world_size=2).indices(1)
>>> sorted(a.tolist() + b.tolist()) == list(range(10))
True

A source whose epochs are drawn from its samples (:class:`mmcache.Mixture`: parts
repeated, chosen or proportioned) gives the sampler an :class:`EpochDraw`: the order of
epoch ``e`` is then ``draw.indices(seed, e)`` (its samples, repeats included, ``size`` of
them) permuted as above; ranks, spans and resumption work on positions of that order
exactly as they do on ``range(size)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from mmcache.errors import ConfigError

__all__ = ["EpochDraw", "EpochSampler"]


class EpochDraw(Protocol):
    """The samples of each epoch of a drawn source (a mixture), before the shuffle."""

    @property
    def size(self) -> int:
        """Samples per epoch (the sampler's ``size``)."""
        ...

    def indices(self, seed: int, epoch: int) -> npt.NDArray[np.int64]:
        """The samples of ``epoch`` (``int64 [size]``, repeats included): a pure function
        of ``(seed, epoch)``; must not be written to."""
        ...


@dataclass(frozen=True)
class EpochSampler:
    """Indices of one rank for each epoch. Immutable, so thread- and process-safe."""

    size: int
    seed: int = 0
    shuffle: bool = True
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False
    #: The samples of each epoch when they are drawn (a mixture); None: ``range(size)``.
    draw: EpochDraw | None = None

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ConfigError(f"dataset size must be >= 0, got {self.size}")
        if self.draw is not None and self.draw.size != self.size:
            raise ConfigError(
                f"the epoch draw gives {self.draw.size} samples per epoch, not size={self.size}"
            )
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    def permutation(self, epoch: int) -> npt.NDArray[np.int64]:
        """The whole-dataset order of ``epoch`` (before splitting between ranks)."""
        drawn = None if self.draw is None else self.draw.indices(self.seed, epoch)
        if not self.shuffle:
            return np.arange(self.size, dtype=np.int64) if drawn is None else drawn.copy()
        # SeedSequence mixes (seed, epoch) properly: seed+epoch would make
        # run (seed=1, epoch=0) replay run (seed=0, epoch=1).
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
        # (int64 already on 64-bit platforms: no second copy of N indices at 10^8 samples)
        order = rng.permutation(self.size).astype(np.int64, copy=False)
        return order if drawn is None else drawn[order]

    def num_samples(self) -> int:
        """Samples per rank per epoch."""
        if self.drop_last:
            return self.size // self.world_size
        return -(-self.size // self.world_size)

    def indices(self, epoch: int) -> npt.NDArray[np.int64]:
        """This rank's indices for ``epoch``, in order."""
        return self._split(self.permutation(epoch), self.num_samples())

    def epoch_stop(self) -> int:
        """Positions of the epoch's order the ranks read, padding left out: ``size``,
        or fewer under ``drop_last`` (the rest is never read this epoch)."""
        return min(self.num_samples() * self.world_size, self.size)

    def span_num_samples(self, start: int, stop: int) -> int:
        """Samples per rank of the part ``[start, stop)`` of an epoch's order."""
        n = max(0, stop - start)
        return n // self.world_size if self.drop_last else -(-n // self.world_size)

    def span_indices(self, epoch: int, start: int, stop: int) -> npt.NDArray[np.int64]:
        """This rank's indices of ``permutation(epoch)[start:stop]`` (the rest of an
        epoch resumed under another world size), split as :meth:`indices` splits a
        whole epoch."""
        if not 0 <= start <= stop <= self.size:
            raise ConfigError(f"need 0 <= start <= stop <= {self.size}, got {start}, {stop}")
        part = self.permutation(epoch)[start:stop]
        return self._split(part, self.span_num_samples(start, stop))

    def _split(self, perm: npt.NDArray[np.int64], per_rank: int) -> npt.NDArray[np.int64]:
        total = per_rank * self.world_size
        if total > perm.shape[0] and perm.shape[0] > 0:
            # Padded by repeating the order from its start: position i is perm[i % len].
            # Only this rank's positions are gathered (a tile of the whole order would
            # copy it twice, 1.6 GB at 10^8 samples, to pad a rank by one sample).
            where = np.arange(self.rank, total, self.world_size, dtype=np.int64)
            padded: npt.NDArray[np.int64] = perm[where % perm.shape[0]]
            return padded
        mine = perm[self.rank : total : self.world_size]
        # A rank of several keeps its own part, not a strided view that holds the whole
        # epoch's order alive (8 bytes per sample of the dataset, per remembered epoch).
        return mine if self.world_size == 1 else mine.copy()
