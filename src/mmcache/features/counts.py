"""What a FeatureCache counts: rows served by each tier or by the encoder, and the encoder's work.

:class:`ServeCounts` is the running tally one FeatureCache keeps in its
process; :class:`FeatureStats` is the frozen record :meth:`FeatureCache.stats`
returns from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from mmcache.stats import TierStats

__all__ = ["ENCODER", "FeatureStats", "ServeCounts"]

#: The source of a row no tier held: the encoder computed it.
ENCODER = "encoder"


@dataclass(frozen=True)
class FeatureStats:
    """Counters of a :class:`FeatureCache` in this process.

    ``samples`` rows were requested; ``hits`` counts those served by each tier
    (``device``, ``memory``, ``disk``), ``misses`` those computed by the
    encoder (a sample repeated within a batch counts once per row but is
    encoded once). ``encoder_calls`` forward calls ran on ``encoded_samples``
    samples in ``encoder_seconds`` (on CUDA timed with events, so a batch's
    time appears once it finished). ``device`` is the device tier's own record.
    """

    samples: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    misses: int = 0
    encoder_calls: int = 0
    encoded_samples: int = 0
    encoder_seconds: float = 0.0
    device: TierStats = field(default_factory=TierStats)

    @property
    def hit_rate(self) -> float:
        """Rows served from any tier / rows requested (0.0 before any call)."""
        return sum(self.hits.values()) / self.samples if self.samples else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["device"] = self.device.as_dict()
        out["hit_rate"] = self.hit_rate
        return out


@dataclass
class ServeCounts:
    """Rows requested, where each was served from, and the encoder's calls, samples and time.

    Create it with a zero in ``hits`` for every tier that may serve (so a tier
    that never served anything still shows). ``timed_samples`` are the encoded
    samples whose time is known yet (on CUDA, once their batch finished), the
    denominator of :meth:`mean_cost`.
    """

    samples: int = 0
    hits: dict[str, int] = field(default_factory=dict)
    misses: int = 0
    encoder_calls: int = 0
    encoded_samples: int = 0
    encoder_seconds: float = 0.0
    timed_samples: int = 0

    def served(self, sources: Iterable[str]) -> None:
        """Count one request's rows by where each came from (a tier name or :data:`ENCODER`)."""
        for src in sources:
            self.samples += 1
            if src == ENCODER:
                self.misses += 1
            else:
                self.hits[src] = self.hits.get(src, 0) + 1

    def timed(self, seconds: float, n_samples: int) -> None:
        """Add the measured encoder time of ``n_samples`` samples."""
        self.encoder_seconds += seconds
        self.timed_samples += n_samples

    def mean_cost(self) -> float:
        """Encoder seconds per sample so far (0.0 before any timing is known)."""
        return self.encoder_seconds / self.timed_samples if self.timed_samples else 0.0

    def stats(self, device: TierStats) -> FeatureStats:
        """The frozen record, with the device tier's own ``device`` record."""
        return FeatureStats(
            samples=self.samples,
            hits=dict(self.hits),
            misses=self.misses,
            encoder_calls=self.encoder_calls,
            encoded_samples=self.encoded_samples,
            encoder_seconds=self.encoder_seconds,
            device=device,
        )
