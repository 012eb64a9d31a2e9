"""Fill a cache ahead of training (``mmcache warm``): resumable, sharded by rank.

Keys already present are skipped before any decode, so a warm-up killed at any
moment resumes where it stopped without recomputing stored entries. Each miss is
produced under the node's claim on its key (:func:`~mmcache.readthrough.read_through`
with ``cache.claims``): a sample another process of the node is producing right now
(another warm-up, a training job's loader) is waited for and taken from the cache,
not produced twice. Under
``torchrun`` every rank takes a disjoint strided part of the dataset
(``rank::world_size``). Misses are produced by DataLoader worker processes,
which admit them to the cache themselves and send back only a status, so no
sample crosses a process boundary. ``executor="ray"`` produces them on Ray tasks
instead, anywhere in a Ray cluster, into the cache's shared tier
(:mod:`mmcache.warmray`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import torch

from mmcache.cache import Cache
from mmcache.checks import check_int
from mmcache.dist import rank_and_world
from mmcache.errors import ConfigError
from mmcache.readthrough import ReadThroughSource, read_through
from mmcache.sources.capabilities import index_count
from mmcache.stats import WarmReport

__all__ = ["Executor", "warm"]

#: Where :func:`warm` produces: ``"local"`` (this process and its ``workers``) or
#: ``"ray"`` (Ray tasks, into the cache's shared tier).
Executor = Literal["local", "ray"]

logger = logging.getLogger(__name__)


class _Produce(torch.utils.data.Dataset[tuple[str, str]]):
    """Worker-side: produce sample ``i`` and put it; return (status, reason)."""

    def __init__(self, dataset: ReadThroughSource, cache: Cache, indices: list[int]) -> None:
        self.dataset = dataset
        self.cache = cache
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> tuple[str, str]:
        i = self.indices[j]
        ds = self.dataset
        key = ds.key(i)
        if self.cache.contains(key):
            return ("present", "")
        got = read_through(
            self.cache,
            key,
            lambda: ds.produce(i),
            claims=self.cache.claims,  # one preparation per node (waits for another's)
            on_error=ds.on_error,
            record_reject=ds.record_reject,
            tag=ds.fingerprint(),
            lookup=False,  # contains() just said it is a miss, and counted nothing
        )
        if got.error is not None:
            return ("rejected", got.error.reason)
        if got.hit:  # another process published it while this one waited (or just before)
            return ("waited" if got.waited else "present", "")
        return ("admitted" if got.admitted else "refused", "")


def _collate(batch: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return batch


def warm(
    dataset: ReadThroughSource,
    cache: Cache,
    *,
    workers: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    progress: bool = True,
    multiprocessing_context: Any = None,
    executor: Executor = "local",
) -> WarmReport:
    """Produce and store every sample of this rank's shard that the cache lacks.

    ``executor="ray"``: produced on Ray tasks (``workers`` is then unused), each
    publishing into the cache's shared tier, which the cache must have
    (``Cache(root, shared=...)``; see :mod:`mmcache.warmray`).
    """
    check_int("workers", workers, minimum=0)  # 0: produce in this process
    if executor not in ("local", "ray"):
        raise ConfigError(f"executor must be 'local' or 'ray', got {executor!r}")
    rank, world_size = rank_and_world(rank, world_size)
    t0 = time.perf_counter()
    cache.register(dataset.fingerprint(), dataset.describe())
    shard = list(range(rank, index_count(dataset), world_size))
    todo = [i for i in shard if not cache.contains(dataset.key(i))]
    present = len(shard) - len(todo)
    counts = {"admitted": 0, "refused": 0, "rejected": 0, "present": 0, "waited": 0}
    if todo and executor == "ray":
        from tqdm import tqdm

        from mmcache.warmray import warm_with_ray

        with tqdm(total=len(shard), initial=present, disable=not progress, unit="sample") as bar:
            counts = {"waited": 0, **warm_with_ray(dataset, cache, todo, progress=bar.update)}
    elif todo:
        from tqdm import tqdm

        loader = torch.utils.data.DataLoader(
            _Produce(dataset, cache, todo),
            batch_size=16,
            num_workers=workers,
            collate_fn=_collate,
            multiprocessing_context=multiprocessing_context if workers > 0 else None,
        )
        with tqdm(
            total=len(shard),
            initial=present,
            disable=not progress,
            unit="sample",
            desc=f"warm rank {rank}/{world_size}" if world_size > 1 else "warm",
        ) as bar:
            for batch in loader:
                for status, _ in batch:
                    counts[status] += 1
                bar.update(len(batch))
    report = WarmReport(
        total=len(shard),
        present=present + counts["present"] + counts["waited"],
        produced=counts["admitted"] + counts["refused"],
        admitted=counts["admitted"],
        rejected=counts["rejected"],
        seconds=time.perf_counter() - t0,
        waited=counts["waited"],
    )
    logger.info("warm: %s", report)
    return report
