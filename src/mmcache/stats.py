"""Typed statistics records and reports.

Every record is a frozen dataclass with :meth:`as_dict`, so users can log it
(TensorBoard, W&B) without knowing its fields, and tests can compare it. They are
gathered here, below every module that returns one (the cache, the loader, the
feature cache, :func:`mmcache.warm`, a chat source's length pass), so that a user
finds every record in one module whatever produced it. Reports that outlive the
process (:class:`TextReport`) are written under the cache root's ``reports/``
folder (:func:`write_report`), where ``mmcache stats`` reads them.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mmcache.rootfiles import make_dir, read_regular, replace_file

__all__ = [
    "REPORTS",
    "CacheStats",
    "EpochStats",
    "FeatureStats",
    "LoaderStats",
    "PartStats",
    "TextReport",
    "TierStats",
    "WarmReport",
    "read_text_reports",
    "write_report",
]

#: The folder of a cache root that holds reports (:class:`TextReport`, a chat source's
#: saved lengths).
REPORTS = "reports"
#: The most bytes a text report may have (a few counts): a bigger one is not read.
_REPORT_MAX_BYTES = 64 * 1024


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


@dataclass(frozen=True)
class FeatureStats:
    """Counters of a :class:`~mmcache.features.FeatureCache` in this process (its
    :meth:`~mmcache.features.FeatureCache.stats`).

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


@dataclass(frozen=True)
class WarmReport:
    """What :func:`mmcache.warm` did on this rank."""

    total: int  # samples of this rank's shard
    present: int  # already cached, skipped (``waited`` included)
    produced: int  # decoded and offered to the cache
    admitted: int  # ... of which a tier admitted
    rejected: int  # bad samples (on_error="skip")
    seconds: float
    waited: int = 0  # ... of ``present``: another process of the node was producing it

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TextReport:
    """What the length pass found (:meth:`mmcache.sources.FileSource.text_report`).

    ``samples``: samples measured; ``with_images``: those keeping an image;
    ``truncated``: cut at ``max_length``; ``fully_masked``: left with no trainable
    token (refused); ``mismatched_placeholders``: records left out at construction
    (placeholder count != images); ``unreadable``: samples whose image header could not
    be read; ``trainable_tokens``: the sum over samples of tokens with a label;
    ``tokens``: the sum of lengths; ``length_percentiles``: p50/p90/p99/max of the
    measured lengths."""

    fingerprint: str
    samples: int
    with_images: int
    truncated: int
    fully_masked: int
    mismatched_placeholders: int
    unreadable: int
    trainable_tokens: int
    tokens: int
    length_percentiles: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data."""
        return asdict(self)

    def __str__(self) -> str:
        pct = "  ".join(f"{k} {v}" for k, v in self.length_percentiles.items())
        return (
            f"text report ({self.fingerprint[:12]}): {self.samples} samples, "
            f"{self.with_images} with images, {self.truncated} truncated, "
            f"{self.fully_masked} fully masked, {self.mismatched_placeholders} mismatched "
            f"placeholders, {self.unreadable} unreadable; {self.trainable_tokens} trainable "
            f"of {self.tokens} tokens; lengths {pct}"
        )

    def write(self, root: str | os.PathLike[str]) -> Path:
        """Record it under the cache ``root`` (``reports/text-<fingerprint>.json``,
        written atomically), where ``mmcache stats`` finds it."""
        path = Path(root) / REPORTS / f"text-{self.fingerprint}.json"
        write_report(path, json.dumps(self.as_dict(), indent=1).encode("utf-8"))
        return path


def read_text_reports(root: str | os.PathLike[str]) -> list[TextReport]:
    """The reports recorded under ``root`` (:meth:`TextReport.write`), newest first;
    unreadable files are ignored."""
    folder = Path(root) / REPORTS
    found: list[tuple[float, TextReport]] = []
    for path in folder.glob("text-*.json") if folder.is_dir() else ():
        try:
            # only a regular file: a FIFO planted in a shared root would block stats
            data = json.loads(read_regular(path, max_bytes=_REPORT_MAX_BYTES))
            found.append((path.stat().st_mtime, TextReport(**data)))
        except (OSError, ValueError, TypeError):
            continue
    return [r for _, r in sorted(found, key=lambda x: -x[0])]


def write_report(path: Path, data: bytes) -> None:
    """Replace ``path`` (``root/reports/...``) by ``data``, never through a link a member
    of a shared root planted (:mod:`mmcache.rootfiles`). Folder and file take the
    root's permissions (a 2770 root: group-shared reports, setgid kept)."""
    root = path.parent.parent
    try:
        folder_mode = stat.S_IMODE(os.stat(root).st_mode) & 0o777
    except FileNotFoundError:  # a root not made yet: made here, private
        folder_mode = 0o700
    make_dir(path.parent, folder_mode)
    replace_file(path, data, folder_mode & 0o666)
