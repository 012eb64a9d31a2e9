"""``CachedDataset``: the simple path, a Dataset that reads through a :class:`Cache`.

Wrap a :class:`MultimodalDataset` and use it with a plain
``torch.utils.data.DataLoader`` and any number of workers: every worker reads
the node-shared memory tier and the disk tier, and admits what it produces.
(``mmcache.DataLoader`` goes further: hits skip the workers entirely.)

Each item carries ``"key"``, the hex cache key, beside the dataset's fields.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.errors import SampleError
from mmcache.keys import key_hex

__all__ = ["CachedDataset"]


class CachedDataset(torch.utils.data.Dataset[dict[str, Any] | None]):
    """A read-through view of ``dataset`` over ``cache``.

    ``on_error`` follows the dataset: under ``"skip"`` a bad sample gives
    ``None`` (use ``collate_fn=mmcache.collate``) and is recorded in
    ``dataset.rejects()``. Process-safe: pickles to workers with the dataset and
    the cache's configuration.
    """

    def __init__(self, dataset: MultimodalDataset, cache: Cache) -> None:
        self.dataset = dataset
        self.cache = cache
        cache.register(dataset.fingerprint(), repr(dataset.pipeline))

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        key = self.dataset.key(index)
        sample = self.cache.get(key)
        if sample is None:
            t0 = time.thread_time()
            try:
                sample = self.dataset.produce(index)
            except SampleError as err:
                if self.dataset.on_error == "raise":
                    raise
                self.dataset.record_reject(err)
                return None
            self.cache.put(
                key, sample, cost=time.thread_time() - t0, tag=self.dataset.fingerprint()
            )
        item = self.dataset.to_item(index, sample)
        item["key"] = key_hex(key)
        return item
