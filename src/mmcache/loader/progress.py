"""``DataLoader(progress=True)``: one tqdm bar per epoch, with samples/s and hit rates.

The bar counts batches as the training loop receives them (not as they are
assembled ahead), so it shows what the loop sees. Its postfix is the epoch's live
counters (:class:`~mmcache.stats.EpochStats`, the figures ``loader.stats()``
gives): samples per second since the epoch began and, for each tier of the cache,
the share of the epoch's samples that tier served (``memory 100%``), plus ``miss``
for the samples this job produced with the pipeline and, when there are any,
``waited`` for those another job on the node was producing (see
:class:`~mmcache.stats.EpochStats`). The counters are read at most twice a
second, so a fast warm epoch does not pay for the bar.

Runs in the training process only; one bar per iteration of the loader (not
thread-safe: as the loader's own iteration is not).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

from tqdm.auto import tqdm

from mmcache.errors import ConfigError
from mmcache.stats import EpochStats

__all__ = ["check_progress", "epoch_postfix", "with_progress"]

#: Seconds between two reads of the live counters (and updates of the postfix).
REFRESH_S = 0.5


def check_progress(progress: object) -> bool:
    """``progress`` itself when it is a bool; ConfigError naming it otherwise."""
    if not isinstance(progress, bool):
        raise ConfigError(f"progress must be True or False, got {progress!r}")
    return progress


def epoch_postfix(stats: EpochStats, tiers: list[str]) -> str:
    """``"1,234 samples/s, memory 98%, disk 2%, miss 0%"``: the bar's postfix (then
    ``waited 5%`` when some samples were another job's to produce)."""
    parts = [f"{stats.samples_per_s:,.0f} samples/s"]
    seen = stats.hits + stats.misses + stats.waited
    if seen:
        for tier in tiers:
            parts.append(f"{tier} {100 * stats.tier_hits.get(tier, 0) / seen:.0f}%")
        parts.append(f"miss {100 * stats.misses / seen:.0f}%")
        if stats.waited:
            parts.append(f"waited {100 * stats.waited / seen:.0f}%")
    return ", ".join(parts)


def with_progress(
    batches: Generator[dict[str, Any], None, None],
    *,
    epoch: int,
    total: int,
    tiers: list[str],
    live: Callable[[], EpochStats | None],
) -> Iterator[dict[str, Any]]:
    """Yield ``batches`` (``total`` of them, epoch ``epoch``) under a tqdm bar whose
    postfix :func:`epoch_postfix` makes from ``live()`` (the epoch's counters, ``None``
    before its first batch). Closing this iterator closes ``batches`` (a ``break`` out
    of the loop stops the epoch as it would without the bar)."""
    bar = tqdm(total=total, desc=f"epoch {epoch}", unit="batch", dynamic_ncols=True)
    last = 0.0
    try:
        for batch in batches:
            bar.update(1)
            now = time.monotonic()
            if now - last >= REFRESH_S or bar.n == total:
                stats = live()
                if stats is not None:
                    bar.set_postfix_str(epoch_postfix(stats, tiers), refresh=False)
                last = now
            yield batch
    finally:
        batches.close()
        bar.close()
