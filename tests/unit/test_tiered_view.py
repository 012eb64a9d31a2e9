"""``TieredStore.view``: the first tier's entry lent without a copy, a lower tier's promoted."""

from __future__ import annotations

from pathlib import Path

from mmcache.cache import Cache

KEY = bytes(range(16))
VALUE = b"v" * 4096


def test_a_first_tier_entry_is_lent_from_shared_memory_not_copied(cache_root: Path) -> None:
    with Cache(cache_root, memory="1MiB", disk="1MiB", temporary=True) as cache:
        store = cache.store
        assert store.put(KEY, VALUE)
        with store.view(KEY) as mv:
            assert mv is not None and bytes(mv) == VALUE
            # The default Store.view lent a bytes copy made by get(): two copies per read.
            assert not isinstance(mv.obj, bytes)
        with store.view(b"x" * 16) as missing:
            assert missing is None


def test_a_lower_tier_entry_is_lent_and_promoted(cache_root: Path) -> None:
    with Cache(cache_root, memory="1MiB", disk="1MiB", temporary=True) as cache:
        memory, disk = cache.memory, cache.disk
        assert memory is not None and disk is not None
        assert disk.put(KEY, VALUE)
        assert not memory.contains(KEY)
        with cache.store.view(KEY) as mv:
            assert mv is not None and bytes(mv) == VALUE
        assert memory.contains(KEY)  # promoted, as get() does
