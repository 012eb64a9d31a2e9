"""The home node of every sample: a seeded partition of the dataset weighted by budgets.

Every process computes the same array from ``(n, weights, seed)`` alone, so no
directory is needed: sample ``i`` lives in the memory tier of node
``home_nodes(...)[i]``. The shares are exact (largest remainder), not drawn
sample by sample, so a node whose budget is half the data holds half the data.

NoPFS refines placement by access frequency; with a random permutation each
epoch every sample is read exactly once per epoch, so all frequencies are equal
and the refinement changes nothing here (``benchmarks/cluster_sim.py`` shows the
partition meets the aggregate bound). Pure functions: thread- and process-safe.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from mmcache.errors import ConfigError

__all__ = ["home_nodes", "shares"]

_PLACEMENT_STREAM = 0x6D6D636C  # separates this draw from the sampler's (seed, epoch)


def shares(n: int, weights: Sequence[float]) -> list[int]:
    """How many of ``n`` samples each node is home to: proportional to ``weights``,
    rounded by largest remainder (they sum to ``n``). All-zero weights share equally."""
    if not weights:
        raise ConfigError("placement needs at least one node")
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or not np.isfinite(w).all():
        raise ConfigError(f"node weights must be finite and >= 0, got {list(weights)}")
    if w.sum() == 0:
        w = np.ones_like(w)
    exact = n * w / w.sum()
    base = np.floor(exact).astype(np.int64)
    left = n - int(base.sum())
    order = np.argsort(-(exact - base), kind="stable")
    base[order[:left]] += 1
    return [int(x) for x in base]


def home_nodes(n: int, weights: Sequence[float], seed: int) -> npt.NDArray[np.int32]:
    """The home node index of each of ``n`` samples (``weights``: one per node)."""
    counts = shares(n, weights)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _PLACEMENT_STREAM])))
    perm = rng.permutation(n)
    home = np.empty(n, dtype=np.int32)
    home[perm] = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
    return home
