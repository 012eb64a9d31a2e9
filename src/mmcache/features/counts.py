"""What a FeatureCache counts: rows served by each tier or by the encoder, and the encoder's work.

:class:`ServeCounts` is the running tally one FeatureCache keeps in its
process; :class:`~mmcache.stats.FeatureStats` is the frozen record :meth:`FeatureCache.stats`
returns from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from mmcache.stats import FeatureStats, TierStats

__all__ = ["ENCODER", "ServeCounts"]

#: The source of a row no tier held: the encoder computed it.
ENCODER = "encoder"


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
