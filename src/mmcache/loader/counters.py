"""The loader's epoch statistics: counted as batches are assembled, checked after each epoch.

:class:`EpochCounter` accumulates one epoch's :class:`~mmcache.stats.EpochStats`
(hits per tier by the tiers' own names, misses, samples waited for, rejects, late
misses, time);
:class:`HitRateWatch` warns once when an epoch's hit rate stays far below what
the cache's budgets should give, with the likeliest reason.
"""

from __future__ import annotations

import collections
import logging
import threading

import numpy as np

from mmcache.cache import Cache
from mmcache.loader.mixing import PartTally
from mmcache.loader.tasks import SampleOrigin
from mmcache.stats import EpochStats
from mmcache.stores.base import Keys
from mmcache.stores.tiered import Promotions
from mmcache.units import format_size

__all__ = ["EpochCounter", "HitRateWatch", "epoch_scalars"]

logger = logging.getLogger(__name__)

#: A row's origin as the per-part tally counts it (absent: not counted).
_PART_KIND: dict[SampleOrigin | None, int] = {
    SampleOrigin.MEMORY_HIT: PartTally.HIT,
    SampleOrigin.DISK_HIT: PartTally.HIT,
    SampleOrigin.PRODUCED: PartTally.MISS,
    SampleOrigin.REJECTED: PartTally.REJECT,
    SampleOrigin.WAITED: PartTally.WAITED,
}


class EpochCounter:
    """Accumulates one epoch's :class:`EpochStats` in the training process. Thread-safe.

    ``promotions``: the cache's (:class:`~mmcache.stores.tiered.Promotions`): a hit of
    an entry this process promoted into the memory tier during this epoch, ahead of its
    gather, counts for the tier it was promoted from, the one whose read served it.
    ``parts``: a mixture's per-part tally (None: one source), fed with the indices the
    assembler passes with each batch's rows.
    """

    def __init__(
        self,
        epoch: int,
        previous: EpochStats | None,
        promotions: Promotions | None = None,
        parts: PartTally | None = None,
    ) -> None:
        p = previous if previous is not None else EpochStats(epoch=epoch)
        self.epoch = epoch
        self.samples, self.batches = p.samples, p.batches
        self.hits, self.misses, self.rejects = p.hits, p.misses, p.rejects
        self.waited = p.waited
        self.late = p.late_misses
        self.seconds, self.stall_s = p.seconds, p.stall_s
        self.tier_hits = dict(p.tier_hits)
        self._promotions = promotions
        self._since = promotions.mark() if promotions is not None else 0
        self._t_begin: float | None = None
        self._seconds_before = p.seconds
        self._parts = parts
        # count() and late_miss() run on both assembling threads.
        self._lock = threading.Lock()

    def begin(self, t: float) -> None:
        if self._t_begin is None:
            self._t_begin = t

    def end(self, t: float) -> None:
        if self._t_begin is not None:
            self.seconds = self._seconds_before + (t - self._t_begin)

    def stall(self, dt: float) -> None:
        self.stall_s += dt

    def late_miss(self) -> None:
        with self._lock:
            self.late += 1

    def count(
        self,
        origins: list[SampleOrigin | None],
        tiers: list[str],
        keys: Keys | None = None,
        indices: np.ndarray | None = None,
    ) -> None:
        """One batch: each row's origin, for a hit the name of the tier it came from,
        the rows' ``keys`` (a row promoted ahead is counted for the tier it was
        promoted from: see the class docstring) and ``indices`` (the rows' samples, for
        the counts per part)."""
        promotions = self._promotions
        # (a Promotions is false while empty: the warm path pays nothing)
        promoted = (
            promotions.take(keys, since=self._since) if promotions and keys is not None else {}
        )
        if promoted:
            tiers = list(tiers)
            for i, tier in promoted.items():
                tiers[i] = tier
        with self._lock:
            if self._parts is not None and indices is not None:
                kinds = np.array([_PART_KIND.get(o, -1) for o in origins], dtype=np.int64)
                self._parts.add(indices, kinds)
            self.batches += 1
            for (origin, tier), k in collections.Counter(zip(origins, tiers, strict=True)).items():
                if origin is SampleOrigin.REJECTED:
                    self.rejects += k
                elif origin is SampleOrigin.PRODUCED:
                    self.misses += k
                    self.samples += k
                elif origin is SampleOrigin.WAITED:
                    self.waited += k
                    self.samples += k
                elif origin is not None:
                    self.hits += k
                    self.samples += k
                    self.tier_hits[tier] = self.tier_hits.get(tier, 0) + k

    def count_hits(self, tier: str, n: int, indices: np.ndarray | None = None) -> None:
        """A batch of ``n`` hits in ``tier``: ``count`` of as many hits, cheaper."""
        with self._lock:
            if self._parts is not None and indices is not None:
                self._parts.add(indices, np.zeros(n, np.int64))
            self.batches += 1
            self.hits += n
            self.samples += n
            self.tier_hits[tier] = self.tier_hits.get(tier, 0) + n

    def snapshot(self) -> EpochStats:
        with self._lock:
            return EpochStats(
                epoch=self.epoch,
                samples=self.samples,
                batches=self.batches,
                hits=self.hits,
                misses=self.misses,
                rejects=self.rejects,
                late_misses=self.late,
                seconds=self.seconds,
                stall_s=self.stall_s,
                tier_hits=dict(self.tier_hits),
                waited=self.waited,
                parts={} if self._parts is None else self._parts.snapshot(),
            )


def epoch_scalars(stats: EpochStats, tiers: list[str]) -> dict[str, float]:
    """What ``on_epoch_end`` receives: scalars ready for TensorBoard or W&B, with a
    ``hit_rate/<tier>`` for each of ``tiers`` and each tier that served a hit."""
    scalars: dict[str, float] = {
        "epoch": float(stats.epoch),
        "samples": float(stats.samples),
        "samples_per_s": stats.samples_per_s,
        "hit_rate": stats.hit_rate,
        "stall_s": stats.stall_s,
        "misses": float(stats.misses),
        "waited": float(stats.waited),
        "rejects": float(stats.rejects),
    }
    total = max(stats.hits + stats.misses + stats.waited, 1)
    for tier in dict.fromkeys([*tiers, *stats.tier_hits]):
        scalars[f"hit_rate/{tier}"] = stats.tier_hits.get(tier, 0) / total
    return scalars


class HitRateWatch:
    """Warns once when the hit rate stays far below what the budgets should give.

    After the first epoch every sample was offered to the cache, so from the
    second epoch on a tier whose budget holds the data should hit nearly
    always, and one that holds a fraction c of it about c of the time
    (``keep``/``value``). Far below that there is a reason worth telling.
    """

    def __init__(self, cache: Cache | None) -> None:
        self._cache = cache
        self._warned = False

    def check(self, stats: EpochStats, *, entry_bytes: int | None, samples: int) -> None:
        """``stats``: an epoch after an epoch seen; ``samples``: all ranks' per epoch."""
        cache = self._cache
        if self._warned or cache is None or stats.epoch < 1 or entry_bytes is None:
            return
        data = entry_bytes * max(samples, 1)
        budget = sum(tier.capacity() for tier in cache.tiers.values())
        # What the tiers really hold bounds it too: a full file system or /dev/shm
        # holds less than the budget (and its store already warned about that).
        held = sum(tier.nbytes() for tier in cache.tiers.values())
        expected = min(1.0, min(budget, held) / data)
        if expected < 0.05 or stats.hit_rate >= 0.5 * expected:
            return
        if cache.policy.name == "lru":
            reason = (
                "policy 'lru' thrashes under per-epoch shuffling (each epoch evicts entries "
                "just before their reuse); use policy='value' (default) or 'keep'"
            )
        elif stats.late_misses > stats.misses // 2:
            reason = (
                "planned hits were evicted before use: another process is churning the "
                "memory tier (another job with another pipeline on the same root?)"
            )
        else:
            reason = (
                "the entries written last epoch are not found again: is the pipeline "
                "fingerprint changing between runs (a tokenizer or transform built "
                "differently each time), or are image files rewritten?"
            )
        logger.warning(
            "epoch %d hit rate %.2f is far below the %.2f the cache budgets should give "
            "(%s of budget for %s of data): %s",
            stats.epoch,
            stats.hit_rate,
            expected,
            format_size(budget),
            format_size(data),
            reason,
        )
        self._warned = True
