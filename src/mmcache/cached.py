"""``CachedDataset``: the simple path, a Dataset that reads through a :class:`Cache`.

Wrap a sample source (a :class:`~mmcache.dataset.MultimodalDataset` or any
:class:`~mmcache.sources.base.SampleSource`) and use it with a plain
``torch.utils.data.DataLoader`` and any number of workers: every worker reads
the node-shared memory tier and the disk tier, and admits what it produces; a
sample another process of the node is producing is waited for, not produced twice.
(``mmcache.DataLoader`` goes further: hits skip the workers entirely.)

Each item carries ``"key"``, the hex cache key, beside the source's fields.
"""

from __future__ import annotations

from typing import Any

import torch

from mmcache.cache import Cache
from mmcache.keys import key_hex
from mmcache.readthrough import ReadThroughSource, read_through

__all__ = ["CachedDataset"]


class CachedDataset(torch.utils.data.Dataset[dict[str, Any] | None]):
    """A read-through view of ``dataset`` over ``cache``.

    ``on_error`` follows the dataset: under ``"skip"`` a bad sample gives
    ``None`` (use ``collate_fn=mmcache.dataset.collate``) and is recorded in
    ``dataset.rejects()``. Process-safe: pickles to workers with the dataset and
    the cache's configuration.
    """

    def __init__(self, dataset: ReadThroughSource, cache: Cache) -> None:
        self.dataset = dataset
        self.cache = cache
        cache.register(dataset.fingerprint(), dataset.describe())

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        ds = self.dataset
        key = ds.key(index)
        got = read_through(
            self.cache,
            key,
            lambda: ds.produce(index),
            claims=self.cache.claims,  # one preparation per node (waits for another's)
            on_error=ds.on_error,
            record_reject=ds.record_reject,
            tag=ds.fingerprint(),
        )
        if got.sample is None:
            return None
        item = ds.to_item(index, got.sample)
        item["key"] = key_hex(key)
        return item
