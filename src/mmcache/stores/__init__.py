"""Where bytes are kept: the tier contract and the built-in tiers (the extension face).

:class:`Store` is a byte store with a hard budget (see :mod:`mmcache.stores.base` for
its rules); :class:`BatchReader` is what the loader gathers a batch's hits through.
:class:`MemoryStore` (node-shared ``/dev/shm``), :class:`DiskStore` (LMDB) and
:class:`TieredStore` (a list of tiers as one store, whose reader is a
:class:`TieredReader`) are the built-ins; :func:`reclaim_orphans` removes the memory
tiers of deleted cache roots. ``mmcache.testing.store_contract`` tests a new tier.
"""

from mmcache.stores.base import BatchReader, Store
from mmcache.stores.disk import DiskStore
from mmcache.stores.gathering import TieredReader
from mmcache.stores.memory import MemoryStore, reclaim_orphans
from mmcache.stores.tiered import TieredStore

__all__ = [
    "BatchReader",
    "DiskStore",
    "MemoryStore",
    "Store",
    "TieredReader",
    "TieredStore",
    "reclaim_orphans",
]
