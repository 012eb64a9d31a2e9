"""The variable-size layout: entries of their own shapes read one by one from the memory tier,
once each, as writable arrays; damaged and expired entries never served."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mmcache import Cache, codec
from mmcache.loader.varying import read_other_shapes
from mmcache.testing.sft import SyntheticSFTSource


def test_entries_of_other_lengths_are_read_whole_and_writable(cache_root: Path) -> None:
    src = SyntheticSFTSource(6, seed=1)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        first = cache.tiers["memory"]
        keys = src.key_rows(np.arange(6))
        for i in range(6):
            assert first.put(keys[i].tobytes(), codec.encode(src.produce(i), ctime=100.0 + i))
        layout = codec.read_header(codec.encode(src.produce(0)))
        good, bad, expired = read_other_shapes(first, layout, keys, src.varying_fields)
        assert sorted(good) == list(range(6)) and bad == [] and expired == []
        for i, sample in good.items():
            want = src.produce(i)
            assert sample.keys() == want.keys()
            for name, arr in sample.items():
                assert arr.flags.writeable  # no copy needed to hand it to torch
                assert arr.dtype == want[name].dtype and np.array_equal(arr, want[name])
        # Two rows never share a buffer (each is its own copy of its entry).
        assert not np.shares_memory(good[0]["input_ids"], good[1]["input_ids"])
        # Entries created before the TTL cutoff are expired, not served.
        good, bad, expired = read_other_shapes(
            first, layout, keys, src.varying_fields, ttl_cutoff=102.5
        )
        assert sorted(good) == [3, 4, 5] and expired == [0, 1, 2] and bad == []


def test_damaged_and_foreign_entries_are_bad(cache_root: Path) -> None:
    src = SyntheticSFTSource(3, seed=2)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        first = cache.tiers["memory"]
        keys = src.key_rows(np.arange(3))
        raw = bytearray(codec.encode(src.produce(0)))
        raw[-1] ^= 0xFF  # a flipped byte in the payload: the checksum fails
        first.put(keys[0].tobytes(), bytes(raw))
        first.put(keys[1].tobytes(), codec.encode({"other": np.zeros(3, np.int32)}))
        layout = codec.read_header(codec.encode(src.produce(2)))
        good, bad, expired = read_other_shapes(first, layout, keys, src.varying_fields)
        assert good == {} and bad == [0, 1] and expired == []  # key 2 absent: neither
