"""Typed statistics records.

Every record is a frozen dataclass with :meth:`as_dict`, so users can log it
(TensorBoard, W&B) without knowing its fields, and tests can compare it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CacheStats", "EpochStats", "LoaderStats", "PartStats", "TierStats"]


@dataclass(frozen=True)
class TierStats:
    """Counters of one tier, aggregated over every process of the node that uses it.

    ``bytes`` is the payload held now (what the budget is checked against),
    ``budget`` the tier's hard limit (``None``: unlimited), ``items`` the entry count.
    """

    hits: int = 0
    misses: int = 0
    puts: int = 0
    admitted: int = 0
    refused: int = 0
    evictions: int = 0
    expired: int = 0
    corrupt: int = 0
    bytes: int = 0
    budget: int | None = None
    items: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses), 0.0 before any read."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        return out


@dataclass(frozen=True)
class CacheStats:
    """One :class:`TierStats` per tier, keyed by the tier's name (``memory``, ``disk``)."""

    tiers: dict[str, TierStats] = field(default_factory=dict)
    #: Pipeline fingerprints that wrote into this cache root (see mmcache.registry).
    fingerprints: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Tiers that could not be opened (``fallback="uncached"``) and why: a memory tier
    #: refused because another user owns its files shows here, not only in the log.
    degraded: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, tier: str) -> TierStats:
        return self.tiers[tier]

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: t.as_dict() for name, t in self.tiers.items()}
        out["fingerprints"] = self.fingerprints
        if self.degraded:
            out["degraded"] = self.degraded
        return out


@dataclass(frozen=True)
class PartStats:
    """One part of a :class:`mmcache.Mixture` in an epoch: its rows served (``samples``:
    ``hits`` from a cache tier, ``misses`` produced, ``waited`` taken from another
    process that was producing them; see :class:`EpochStats`) and ``rejects`` left out."""

    samples: int = 0
    hits: int = 0
    misses: int = 0
    rejects: int = 0
    waited: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses + self.waited
        return self.hits / total if total else 0.0

    def __add__(self, other: PartStats) -> PartStats:
        return PartStats(
            self.samples + other.samples,
            self.hits + other.hits,
            self.misses + other.misses,
            self.rejects + other.rejects,
            self.waited + other.waited,
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        return out


@dataclass(frozen=True)
class EpochStats:
    """One epoch of a :class:`~mmcache.loader.DataLoader`, as seen by the consuming process.

    ``hits`` are samples served from a cache tier (``tier_hits`` splits them by
    the tier that served them: a hit of an entry promoted from the disk tier into
    memory just before it was gathered is the disk tier's), ``misses`` samples this
    job produced with the pipeline, ``waited`` samples another process of the node was
    producing when this job asked for them (the claim protocol of
    :mod:`mmcache.stores.claims`): this job waited and took what that process
    published, so they are neither decodes of this job nor cache hits. Each sample
    served is one of the three. ``stall_s`` is the time
    the training loop spent waiting inside ``next(loader)``; ``seconds`` the wall
    time from the first request to the last batch. ``late_misses`` counts hits
    planned ahead that were evicted before use and produced in the consumer.
    ``parts``: the same per part of a :class:`mmcache.Mixture`, by name (empty for one
    source).
    """

    epoch: int
    samples: int = 0
    batches: int = 0
    hits: int = 0
    misses: int = 0
    rejects: int = 0
    late_misses: int = 0
    seconds: float = 0.0
    stall_s: float = 0.0
    tier_hits: dict[str, int] = field(default_factory=dict)
    waited: int = 0
    parts: dict[str, PartStats] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses + waited): the share of the samples served that the
        cache held when asked, 0.0 before any."""
        total = self.hits + self.misses + self.waited
        return self.hits / total if total else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        out["samples_per_s"] = self.samples_per_s
        out["parts"] = {name: p.as_dict() for name, p in self.parts.items()}
        return out


@dataclass(frozen=True)
class LoaderStats:
    """Totals over every epoch so far, and one :class:`EpochStats` per epoch."""

    epochs: tuple[EpochStats, ...] = ()

    @property
    def hits(self) -> int:
        return sum(e.hits for e in self.epochs)

    @property
    def misses(self) -> int:
        return sum(e.misses for e in self.epochs)

    @property
    def waited(self) -> int:
        return sum(e.waited for e in self.epochs)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses + self.waited
        return self.hits / total if total else 0.0

    @property
    def stall_s(self) -> float:
        return sum(e.stall_s for e in self.epochs)

    @property
    def tier_hits(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.epochs:
            for tier, n in e.tier_hits.items():
                out[tier] = out.get(tier, 0) + n
        return out

    @property
    def parts(self) -> dict[str, PartStats]:
        """Per part of a mixture, summed over the epochs (empty for one source)."""
        out: dict[str, PartStats] = {}
        for e in self.epochs:
            for name, p in e.parts.items():
                out[name] = out.get(name, PartStats()) + p
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "waited": self.waited,
            "hit_rate": self.hit_rate,
            "stall_s": self.stall_s,
            "tier_hits": self.tier_hits,
            "epochs": [e.as_dict() for e in self.epochs],
            "parts": {name: p.as_dict() for name, p in self.parts.items()},
        }
