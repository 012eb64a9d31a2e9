"""``mmcache.plot``: per-epoch throughput and hit rate per tier, as a PNG (headless).

>>> mmcache.plot(loader.stats(), "epochs.png")  # doctest: +SKIP

matplotlib is an optional extra (``pip install 'mmcache[plot]'``): a 60-line figure is not
worth a required dependency of every training job. It is imported only when a figure is
drawn, so ``import mmcache`` never needs it; without it :func:`plot` raises a
:class:`~mmcache.errors.ConfigError` that names the extra, as every other extra does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmcache.errors import ConfigError
from mmcache.stats import EpochStats, LoaderStats

__all__ = ["plot", "require_matplotlib", "tier_shares"]


def require_matplotlib() -> Any:
    """matplotlib's ``Figure`` class; ConfigError naming the ``plot`` extra when matplotlib
    is not installed. Callers that plot at the end of a long run (``mmcache demo``) call it
    first, so a missing extra is reported before the work rather than after it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError(
            f"mmcache.plot needs matplotlib ({exc}): pip install 'mmcache[plot]'"
        ) from exc
    return Figure


def tier_shares(epochs: Sequence[EpochStats]) -> dict[str, list[float]]:
    """Each tier's hits per epoch as a share of the samples served that epoch (hits,
    misses and ``waited``: a sample taken from another process's production is neither
    a hit nor a miss, yet it was served), tiers in name order; 0.0 for an empty epoch.
    Summed over the tiers, an epoch's shares are its :attr:`EpochStats.hit_rate`."""
    served = [e.hits + e.misses + e.waited for e in epochs]
    tiers = sorted({t for e in epochs for t in e.tier_hits})
    return {
        tier: [
            (e.tier_hits.get(tier, 0) / n) if n else 0.0
            for e, n in zip(epochs, served, strict=True)
        ]
        for tier in tiers
    }


def plot(
    stats: LoaderStats | Sequence[EpochStats],
    path: str | os.PathLike[str],
    *,
    title: str = "mmcache: per-epoch throughput and hit rate",
) -> Path:
    """Write a two-panel figure: samples/s per epoch, and hit rate per tier per epoch.

    Uses matplotlib's non-interactive Agg backend, so it works without a display
    and never changes the backend of a user's other figures. ConfigError naming the
    ``plot`` extra when matplotlib is not installed.
    """
    Figure = require_matplotlib()
    epochs = list(stats.epochs if isinstance(stats, LoaderStats) else stats)
    xs = [e.epoch for e in epochs]
    fig = Figure(figsize=(9, 3.6), dpi=110)
    ax1, ax2 = fig.subplots(1, 2)
    ax1.bar(xs, [e.samples_per_s for e in epochs], color="#4C72B0")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("samples / s")
    ax1.set_xticks(xs)
    ax1.set_title("throughput")
    shares = tier_shares(epochs)
    tiers = list(shares)
    bottom = [0.0] * len(epochs)
    colors = {"memory": "#55A868", "disk": "#C44E52"}
    for tier, share in shares.items():
        ax2.bar(xs, share, bottom=bottom, label=f"{tier} hits", color=colors.get(tier))
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("hit rate")
    ax2.set_xticks(xs)
    ax2.set_title("hit rate per tier")
    if tiers:
        ax2.legend(loc="upper left", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
