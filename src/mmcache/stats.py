"""Typed statistics records.

Every record is a frozen dataclass with :meth:`as_dict`, so users can log it
(TensorBoard, W&B) without knowing its fields, and tests can compare it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CacheStats", "TierStats"]


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

    def __getitem__(self, tier: str) -> TierStats:
        return self.tiers[tier]

    def as_dict(self) -> dict[str, Any]:
        return {name: t.as_dict() for name, t in self.tiers.items()}
