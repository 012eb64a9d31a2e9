"""Cache: tiers, promotion, TTL, corruption, verify/gc, fallback, CachedDataset."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmcache import codec
from mmcache.cache import Cache
from mmcache.cached import CachedDataset
from mmcache.dataset import MultimodalDataset, collate
from mmcache.errors import CacheError, ConfigError
from mmcache.keys import as_key, digest, key_hex, sample_key
from mmcache.stores.memory import store_dir
from mmcache.transforms import ImageSpec, TextSpec
from mmcache.transforms.pipeline import Pipeline


def _key(i: int) -> bytes:
    return sample_key(f"id{i}", "stamp", "fp")


def _sample(i: int, n: int = 1000) -> dict[str, np.ndarray]:
    return {"x": np.full(n, i % 251, dtype=np.uint8), "i": np.array([i], dtype=np.int64)}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_put_get_round_trip_both_tiers(cache_root: Path) -> None:
    with Cache(cache_root, memory="1MiB", disk="4MiB", temporary=True) as cache:
        assert cache.get(_key(1)) is None
        assert cache.put(_key(1), _sample(1), cost=0.01)
        got = cache.get(_key(1))
        assert got is not None and got["i"].tolist() == [1] and not got["x"].flags.writeable
        assert cache.get(key_hex(_key(1))) is not None  # hex keys work too
        s = cache.stats()
        assert s["memory"].hits == 2 and s["memory"].misses == 1 and s["memory"].items == 1
        assert s["disk"].items == 1 and s["disk"].bytes > 1000
        assert _key(1) in cache and cache.contains(key_hex(_key(1)))


def test_any_str_or_bytes_is_a_key(cache_root: Path) -> None:
    raw = _key(3)
    with Cache(cache_root, memory="1MiB", disk="4MiB", temporary=True) as cache:
        names: list[str | bytes] = ["k0", "sample/001.jpg", b"abc", "", b"", "abc"]
        for i, name in enumerate(names):
            assert cache.put(name, _sample(i, 10), cost=0.01)
        for i, name in enumerate(names):
            got = cache.get(name)
            assert got is not None and got["i"].tolist() == [i], name  # "abc" != b"abc"
            assert cache.contains(name) and name in cache
        assert cache.delete("k0") and not cache.contains("k0") and cache.get("k0") is None
        assert cache.get("sample/001.jpg") is not None  # the others are still there
        # The 16-byte key and its 32-hex form (either case) still name the raw key.
        cache.put(raw, _sample(9, 10), cost=0.01)
        for form in (raw, key_hex(raw), key_hex(raw).upper()):
            got = cache.get(form)
            assert got is not None and got["i"].tolist() == [9]
        assert as_key(raw) == raw and as_key(key_hex(raw)) == raw
        assert as_key("k0") == digest("mmcache.key", "k0") and len(as_key(b"abc")) == 16
        assert as_key(raw.hex()[:-1]) != as_key(raw.hex()[:-1] + "0")  # 31 digits: hashed
        assert as_key(raw + b"!") != raw and len(as_key(raw[:15])) == 16
        with pytest.raises(TypeError, match="str or bytes"):
            cache.get(3)  # type: ignore[arg-type]


_HEX32 = re.compile(r"[0-9a-fA-F]{32}")


def _spelled(text: str) -> str:
    """The key a text names: a 32-hex text spells a raw key in either case."""
    return text.lower() if _HEX32.fullmatch(text) else text


def test_any_text_round_trips_as_a_key(cache_root: Path) -> None:
    with Cache(cache_root, memory="1MiB", disk=None, temporary=True) as cache:

        @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(texts=st.lists(st.text(max_size=40), min_size=1, max_size=6, unique_by=_spelled))
        def check(texts: list[str]) -> None:
            assert len({as_key(t) for t in texts}) == len(texts)
            for i, text in enumerate(texts):
                assert as_key(text) == as_key(text) and len(as_key(text)) == 16
                assert cache.put(text, _sample(i, 4), cost=0.01)
            for i, text in enumerate(texts):
                got = cache.get(text)
                assert got is not None and got["i"].tolist() == [i]
            for text in texts:
                assert cache.delete(text) and not cache.contains(text)

        check()


def test_disk_hit_is_verified_and_promoted(cache_root: Path) -> None:
    with Cache(cache_root, memory=0, disk="4MiB") as cache:
        cache.put(_key(2), _sample(2), cost=0.5)
    with Cache(cache_root, memory="1MiB", disk="4MiB", temporary=True) as cache:
        sample, tier = cache.lookup(_key(2))
        assert tier == "disk" and sample is not None and sample["i"].tolist() == [2]
        assert cache.memory is not None and cache.memory.contains(_key(2))
        info = cache.memory.info(_key(2))
        assert info is not None and info.cost == pytest.approx(0.5)  # cost carried along
        assert cache.lookup(_key(2))[1] == "memory"


def test_ttl_expires_entries(cache_root: Path) -> None:
    clock = FakeClock()
    with Cache(
        cache_root, memory="1MiB", disk="4MiB", ttl="1h", clock=clock, temporary=True
    ) as cache:
        cache.put(_key(3), _sample(3))
        clock.now += 1800
        assert cache.get(_key(3)) is not None
        clock.now += 3600
        assert cache.get(_key(3)) is None  # expired: a miss, and removed
        assert not cache.contains(_key(3))


def test_gc_removes_expired(cache_root: Path) -> None:
    clock = FakeClock()
    with Cache(
        cache_root, memory="1MiB", disk="4MiB", ttl=10, clock=clock, temporary=True
    ) as cache:
        for i in range(5):
            cache.put(_key(i), _sample(i))
        clock.now += 5
        cache.put(_key(9), _sample(9))
        clock.now += 6
        report = cache.gc()
        assert report.expired == 5 * 2  # five entries in each of two tiers
        assert report.freed_bytes > 0
        assert cache.get(_key(9)) is not None


def test_corrupt_disk_entry_is_dropped_counted_never_served(cache_root: Path) -> None:
    import lmdb

    with Cache(cache_root, memory=0, disk="4MiB") as cache:
        cache.put(_key(4), _sample(4))
    env = lmdb.open(str(cache_root / "disk"), max_dbs=8, subdir=True)
    data = env.open_db(b"data")
    with env.begin(write=True) as txn:
        raw = bytearray(txn.get(_key(4), db=data))
        raw[-1] ^= 0xFF  # flip one payload byte
        txn.put(_key(4), bytes(raw), db=data)
    env.close()
    with Cache(cache_root, memory=0, disk="4MiB") as cache:
        report = cache.verify()
        assert not report.ok and report.bad == (key_hex(_key(4)),)
        assert cache.get(_key(4)) is None
        assert cache.stats()["disk"].corrupt >= 1
        assert not cache.contains(_key(4))


def test_verify_repair_and_open_existing(cache_root: Path) -> None:
    with Cache(cache_root, memory=0, disk="4MiB", policy="lru", ttl="7d") as cache:
        for i in range(3):
            cache.put(_key(i), _sample(i))
    reopened = Cache.open_existing(cache_root)
    try:
        assert reopened.disk_budget == 4 * 1024 * 1024 and reopened.policy.name == "lru"
        assert reopened.ttl == 7 * 86400
        assert reopened.verify().checked >= 3 and reopened.verify().ok
    finally:
        reopened.close()
    with pytest.raises(CacheError, match="not an mmcache cache root"):
        Cache.open_existing(cache_root / "nowhere")


def test_gc_max_size_shrinks_the_disk_tier(cache_root: Path) -> None:
    with Cache(cache_root, memory=0, disk="4MiB") as cache:
        for i in range(20):
            cache.put(_key(i), _sample(i, n=50_000))
        assert cache.disk is not None
        assert cache.disk.nbytes() > 500_000
        report = cache.gc(max_size="500KiB")
        assert cache.disk.nbytes() <= 500 * 1024 and report.evicted > 0
    assert Cache.open_existing(cache_root, memory=0).disk_budget == 500 * 1024


def test_get_or_produce_measures_cost(cache_root: Path) -> None:
    calls = []

    def produce() -> dict[str, np.ndarray]:
        calls.append(1)
        x = np.zeros(200_000)
        for _ in range(20):
            x = np.sqrt(x + 1.0)
        return _sample(5)

    with Cache(cache_root, memory="1MiB", temporary=True) as cache:
        a = cache.get_or_produce(_key(5), produce)
        b = cache.get_or_produce(_key(5), produce)
        assert calls == [1] and a["i"].tolist() == b["i"].tolist() == [5]
        assert cache.memory is not None
        info = cache.memory.info(_key(5))
        assert info is not None and info.cost > 0


def test_memory_budget_is_hard(cache_root: Path) -> None:
    with Cache(cache_root, memory=100_000, policy="lru", temporary=True) as cache:
        for i in range(50):
            cache.put(_key(i), _sample(i, n=9000))
            assert cache.memory is not None and cache.memory.nbytes() <= 100_000
        assert cache.stats()["memory"].evictions > 0


def test_bad_arguments(cache_root: Path) -> None:
    with pytest.raises(ConfigError):
        Cache(cache_root, memory="10GB")
    with pytest.raises(ConfigError):
        Cache(cache_root, memory=0, policy="mru")
    with pytest.raises(ConfigError):
        Cache(cache_root, memory=0, fallback="ignore")  # type: ignore[arg-type]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_root_raises_or_falls_back(tmp_path: Path) -> None:  # pragma: no cover
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(CacheError, match="fallback='uncached'"):
        Cache(ro / "c", memory=0, disk="1MiB")
    cache = Cache(ro / "c", memory=0, disk="1MiB", fallback="uncached")
    assert cache.disk is None


def test_unusable_disk_root_falls_back_when_allowed(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CacheError, match="fallback='uncached'"):
        Cache(blocker / "cache", memory=0, disk="1MiB")
    cache = Cache(blocker / "cache", memory=0, disk="1MiB", fallback="uncached")
    assert cache.disk is None and cache.get(_key(1)) is None
    assert cache.put(_key(1), _sample(1)) is False  # uncached: nothing admitted, no error


def test_pickled_cache_reattaches(cache_root: Path) -> None:
    import pickle

    with Cache(cache_root, memory="1MiB", disk="4MiB", temporary=True) as cache:
        cache.put(_key(7), _sample(7))
        twin = pickle.loads(pickle.dumps(cache))
        try:
            got = twin.get(_key(7))
            assert got is not None and got["i"].tolist() == [7]
        finally:
            twin.close()


@pytest.mark.parametrize(("workers", "ctx"), [(2, "fork"), (2, "spawn")])
def test_cached_dataset_with_torch_workers(
    tiny_data: Path, small_pipeline: Pipeline, cache_root: Path, workers: int, ctx: str
) -> None:
    ds = MultimodalDataset(tiny_data, pipeline=small_pipeline)
    with Cache(cache_root, memory="8MiB", disk="16MiB", temporary=True) as cache:
        cds = CachedDataset(ds, cache)
        loader = torch.utils.data.DataLoader(
            cds,
            batch_size=8,
            num_workers=workers,
            multiprocessing_context=ctx,
            collate_fn=collate,
        )
        first = list(loader)
        second = list(loader)
        for a, b in zip(first, second, strict=True):
            assert a["id"] == b["id"] and torch.equal(a["image"], b["image"])
            assert a["key"] == [key_hex(ds.key(ds.records.index_of(i))) for i in a["id"]]
        s = cache.stats()["memory"]
        assert s.items == 48 and s.hits >= 48  # the second pass hit, in the workers
        direct = ds[5]
        assert direct is not None
        assert torch.equal(direct["image"], first[0]["image"][5])


def test_invalidation_touch_caption_pipeline(
    tmp_path: Path, tiny_data: Path, tokenizer_json: Path, cache_root: Path
) -> None:
    import json

    recs = [json.loads(x) for x in tiny_data.read_text().splitlines()[:4]]
    img = tmp_path / "img.jpg"
    img.write_bytes((tiny_data.parent / recs[0]["image_path"]).read_bytes())
    manifest = tmp_path / "m.jsonl"

    def write(caption: str) -> None:
        manifest.write_text(json.dumps({"id": "a", "image_path": "img.jpg", "caption": caption}))

    pipe = Pipeline(image=ImageSpec(size=32), text=TextSpec(tokenizer_json, max_length=8))
    with Cache(cache_root, memory="4MiB", temporary=True) as cache:
        write("a red cat")
        ds = MultimodalDataset(manifest, pipeline=pipe)
        cds = CachedDataset(ds, cache)
        cds[0]
        assert cache.get(ds.key(0)) is not None  # now cached
        first_key = ds.key(0)
        # 1. touch the image file: the same bytes keep their key and their entry
        st = img.stat()
        os.utime(img, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert ds.key(0) == first_key and cache.get(ds.key(0)) is not None
        # 1b. other bytes in the same file: a new key, never the old entry
        img.write_bytes((tiny_data.parent / recs[1]["image_path"]).read_bytes())
        assert cache.get(ds.key(0)) is None and ds.key(0) != first_key
        # 2. change the caption
        write("a blue dog")
        ds2 = MultimodalDataset(manifest, pipeline=pipe)
        assert cache.get(ds2.key(0)) is None
        # 3. change the pipeline
        pipe3 = Pipeline(image=ImageSpec(size=48), text=TextSpec(tokenizer_json, max_length=8))
        ds3 = MultimodalDataset(manifest, pipeline=pipe3)
        assert cache.get(ds3.key(0)) is None
        # and the changed samples really are the new ones
        item = CachedDataset(ds3, cache)[0]
        assert item is not None and item["image"].shape == (3, 48, 48)


def test_entry_too_large_refused_and_counted(cache_root: Path) -> None:
    with Cache(cache_root, memory=10_000, temporary=True) as cache:
        assert cache.put(_key(1), _sample(1, n=20_000)) is False
        assert cache.stats()["memory"].refused == 1
        assert codec.encoded_size(_sample(1, n=20_000)) > 10_000


def test_fingerprints_listed_and_unused_ones_dropped(
    tiny_data: Path, tokenizer_json: Path, cache_root: Path
) -> None:
    """Two pipelines write into one root; gc drops only the one nobody used lately."""
    clock = FakeClock()
    old = Pipeline(image=ImageSpec(size=32), text=TextSpec(tokenizer_json, max_length=8))
    new = Pipeline(image=ImageSpec(size=40), text=TextSpec(tokenizer_json, max_length=8))
    with Cache(cache_root, memory="8MiB", disk="64MiB", clock=clock, temporary=True) as cache:
        ds_old = MultimodalDataset(tiny_data, pipeline=old)
        for i in range(10):
            CachedDataset(ds_old, cache)[i]
        clock.now += 40 * 86400
        ds_new = MultimodalDataset(tiny_data, pipeline=new)
        for i in range(6):
            CachedDataset(ds_new, cache)[i]
        fps = cache.stats().fingerprints
        assert set(fps) == {old.fingerprint(), new.fingerprint()}
        assert fps[old.fingerprint()]["keys_logged"] == 10
        report = cache.gc(unused_for="30d")
        assert report.dropped_fingerprints == (old.fingerprint(),)
        assert report.dropped_entries == 10 * 2  # memory and disk copies
        assert all(cache.get(ds_old.key(i)) is None for i in range(10))
        assert all(cache.get(ds_new.key(i)) is not None for i in range(6))
        assert set(cache.stats().fingerprints) == {new.fingerprint()}


def test_loader_and_workers_tag_their_entries(
    tiny_data: Path, small_pipeline: Pipeline, cache_root: Path
) -> None:
    from mmcache.loader import DataLoader

    ds = MultimodalDataset(tiny_data, pipeline=small_pipeline)
    with Cache(cache_root, memory="8MiB", disk="64MiB", temporary=True) as cache:
        with DataLoader(ds, cache=cache, batch_size=8, num_workers=2) as loader:
            list(loader)
        info = cache.stats().fingerprints[small_pipeline.fingerprint()]
        assert info["keys_logged"] == 48


def test_open_existing_records_nothing_and_never_creates_the_memory_tier(
    cache_root: Path,
) -> None:
    import glob
    import json
    import pickle

    from mmcache.cache import _memory_name
    from mmcache.stores.memory import unlink_store

    with Cache(cache_root, memory="1MiB", disk="4MiB") as cache:
        for i in range(3):
            cache.put(_key(i), _sample(i))
    config = (cache_root / "cache.json").read_bytes()
    with Cache.open_existing(cache_root, memory=0, ttl=5) as inspected:
        assert inspected.ttl == 5 and inspected.memory is None
        pickle.loads(pickle.dumps(inspected)).close()  # a worker's copy
    with Cache.open_existing(cache_root) as inspected:
        assert inspected.gc(max_size="3MiB").evicted == 0
    recorded = json.loads((cache_root / "cache.json").read_text())
    assert recorded == {**json.loads(config), "disk": 3 * 2**20}  # only what gc changed
    # The recorded memory budget differs from the store's: attach it as it is, never wipe it.
    (cache_root / "cache.json").write_text(json.dumps({**recorded, "memory": 2 * 2**20}))
    with Cache.open_existing(cache_root) as inspected:
        assert inspected.memory is not None and len(inspected.memory) == 3
        assert inspected.memory.capacity() == 2**20 and inspected.absent_tiers == ()
    name = _memory_name(cache_root.absolute())
    unlink_store(name)
    with Cache.open_existing(cache_root) as inspected:
        assert inspected.memory is None and inspected.absent_tiers == ("memory",)
        assert inspected.verify().tiers == ("disk",)
    assert glob.glob(f"{store_dir()}/mmcache-{name}*") == []


def test_gc_older_than_applies_once(cache_root: Path) -> None:
    clock = FakeClock()
    with Cache(cache_root, memory="1MiB", disk="4MiB", clock=clock, temporary=True) as cache:
        for i in range(5):
            cache.put(_key(i), _sample(i))
        clock.now += 10
        cache.put(_key(9), _sample(9))
        assert cache.gc(older_than="5s").expired == 5 * 2  # both tiers
        assert cache.ttl is None and cache.get(_key(9)) is not None
        clock.now += 10
        assert cache.gc().expired == 0
        with pytest.raises(ConfigError, match="duration"):
            cache.gc(older_than="-1d")


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"memory": 2**63, "disk": None}, "memory"),
        ({"memory": 2**70, "disk": None}, "memory"),
        ({"memory": 0, "disk": 2**63}, "disk"),
        ({"memory": 0, "disk": "99999999999999999999TiB"}, "disk"),
        ({"memory": "1MiB", "disk": None, "memory_entries": 0}, "memory_entries"),
        ({"memory": "1MiB", "disk": None, "memory_entries": 2**40}, "memory_entries"),
        ({"memory": "1MiB", "disk": None, "memory_entries": "many"}, "memory_entries"),
    ],
)
def test_budgets_out_of_range_are_config_errors_naming_the_parameter(
    cache_root: Path, options: dict[str, object], named: str
) -> None:
    """G20: 2**63 bytes was an OverflowError traceback, memory_entries=0 named
    ``index_capacity``; both are ConfigErrors naming what the user passed."""
    with pytest.raises(ConfigError, match=rf"^{named} must be"):
        Cache(cache_root, temporary=True, **options)  # type: ignore[arg-type]
    assert not cache_root.exists()  # refused before anything was made
