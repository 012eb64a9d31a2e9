"""A compact disk tier (``disk_form="jpeg:Q"`` / ``"zstd"``) gathers its hits in the
training process, decoding them into the batch (issue 17): never through a worker,
bitwise the batches the workers' unpack gives, and a damaged entry is never served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmcache import codec
from mmcache.cache import Cache
from mmcache.codec.compact import _JPEG_PREFIX, parse_disk_form
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.loader.tasks import WorkerPlanner
from mmcache.stores.disk import DiskStore
from mmcache.stores.disk.formed import FormedDiskStore
from mmcache.transforms.pipeline import Pipeline

FIELDS = ("image", "input_ids", "attention_mask")


def _epoch(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return list(loader)


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"] and x["key"] == y["key"]
        for name in FIELDS:
            assert torch.equal(x[name], y[name]), name


@pytest.fixture
def ds(tiny_data: Path, small_pipeline: Pipeline) -> MultimodalDataset:
    return MultimodalDataset(tiny_data, pipeline=small_pipeline)


@pytest.fixture
def reference(ds: MultimodalDataset) -> list[list[dict[str, Any]]]:
    loader = DataLoader(ds, cache=None, batch_size=10, seed=3)
    return [_epoch(loader, e) for e in range(2)]


def _spy_workers(monkeypatch: pytest.MonkeyPatch, ds: MultimodalDataset) -> list[int]:
    """Every row a worker task looks up or produces, and every produce (``-1 - i``)."""
    ran: list[int] = []
    real_run = WorkerPlanner.run

    def spy(self: Any, index: int, key: bytes, **kw: Any) -> Any:
        ran.append(index)
        return real_run(self, index, key, **kw)

    monkeypatch.setattr(WorkerPlanner, "run", spy)
    original = ds.produce

    def counting(index: int) -> Any:
        ran.append(-1 - index)
        return original(index)

    monkeypatch.setattr(ds, "produce", counting)
    return ran


def _cache(root: Path, form: str) -> Cache:
    return Cache(root, memory=0, disk="64MiB", disk_form=form)


def _fill(ds: MultimodalDataset, root: Path, form: str) -> None:
    with _cache(root, form) as cache:
        _epoch(DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=0), 0)


def _served(ds: MultimodalDataset, root: Path, form: str, *, in_process: bool) -> Any:
    """Epoch 1 from the disk tier alone: gathered here, or (today's other path) looked up
    and unpacked by the loader's workers."""
    with _cache(root, form) as cache:
        assert isinstance(cache.disk, FormedDiskStore)
        if not in_process:
            cache.disk.supports_gather = False  # the workers' path
        assert (cache.reader is not None) is in_process
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=2)
        out = _epoch(loader, 1)
        e = loader.stats().epochs[0]
        assert e.misses == 0 and e.tier_hits == {"disk": 48}
        return out, cache.stats()["disk"].corrupt


@pytest.mark.parametrize("form", ["zstd", "jpeg:90"])
def test_in_process_batches_equal_the_workers_batches_bitwise_and_across_runs(
    ds: MultimodalDataset,
    reference: list[list[dict[str, Any]]],
    cache_root: Path,
    tmp_path: Path,
    form: str,
) -> None:
    _fill(ds, cache_root, form)
    here, _ = _served(ds, cache_root, form, in_process=True)
    workers, _ = _served(ds, cache_root, form, in_process=False)
    _same(here, workers)
    _fill(ds, tmp_path / "again", form)
    again, _ = _served(ds, tmp_path / "again", form, in_process=True)
    _same(here, again)  # a new cache, a new run: the same pixels
    if form == "zstd":
        _same(here, reference[1])  # lossless: the uncached batches


@pytest.mark.parametrize("form", ["zstd", "jpeg:90"])
def test_formed_disk_hits_never_reach_a_worker(
    ds: MultimodalDataset, cache_root: Path, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    _fill(ds, cache_root, form)
    with _cache(cache_root, form) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=0)
        ran = _spy_workers(monkeypatch, ds)
        _epoch(loader, 1)
        assert ran == []  # no row was looked up, unpacked or produced by a worker task
        e = loader.stats().epochs[0]
        assert e.hits == 48 and e.tier_hits == {"disk": 48}


def _stored(root: Path, form: str, key: bytes) -> bytes:
    """The bytes the formed tier holds for ``key`` (its compact form)."""
    with DiskStore(root / f"disk-{parse_disk_form(form).tag}", capacity="64MiB") as disk:
        stored = disk.get(key)
    assert stored is not None and codec.verify(stored)
    return stored


def _flip_in_file(path: Path, needle: bytes) -> None:
    """Flip a byte in every copy of ``needle`` in ``path``: LMDB may keep a stale copy of a
    rewritten page in its free pages beside the live one, and either may hold the entry."""
    data = path.read_bytes()
    found = []
    at = data.find(needle)
    while at >= 0:
        found.append(at)
        at = data.find(needle, at + 1)
    assert found, "the entry's bytes are not in the file"
    with open(path, "r+b") as f:
        for at in found:
            f.seek(at + len(needle) // 2)
            byte = f.read(1)
            f.seek(at + len(needle) // 2)
            f.write(bytes([byte[0] ^ 0x5A]))


def _rows_by_id(batches: list[dict[str, Any]]) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for b in batches:
        for i, sid in enumerate(b["id"]):
            out[int(sid)] = {name: b[name][i] for name in FIELDS}
    return out


@pytest.mark.parametrize("form", ["zstd", "jpeg:90"])
def test_a_damaged_stored_entry_mid_batch_is_discarded_and_produced_again(
    ds: MultimodalDataset,
    reference: list[list[dict[str, Any]]],
    cache_root: Path,
    monkeypatch: pytest.MonkeyPatch,
    form: str,
) -> None:
    _fill(ds, cache_root, form)
    clean, _ = _served(ds, cache_root, form, in_process=True)
    victim = 5
    stored = _stored(cache_root, form, ds.key(victim))
    payload = max(codec.decode(stored).values(), key=lambda a: a.nbytes).tobytes()
    folder = cache_root / f"disk-{parse_disk_form(form).tag}"
    _flip_in_file(folder / "data.mdb", payload[len(payload) // 2 : len(payload) // 2 + 256])
    with _cache(cache_root, form) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=0)
        ran = _spy_workers(monkeypatch, ds)
        got = _epoch(loader, 1)
        assert [r for r in ran if r < 0] == [-1 - victim]  # produced again, alone
        assert cache.stats()["disk"].corrupt == 1
        e = loader.stats().epochs[0]
        assert e.hits == 47
    want, fresh, served = _rows_by_id(clean), _rows_by_id(reference[1]), _rows_by_id(got)
    for sid, row in served.items():
        expect = fresh[sid] if sid == victim else want[sid]  # never the damaged bytes
        for name in FIELDS:
            assert torch.equal(row[name], expect[name]), (sid, name)
    assert codec.verify(_stored(cache_root, form, ds.key(victim)))  # written back


def test_a_jpeg_that_does_not_decode_is_discarded_never_served(
    ds: MultimodalDataset, cache_root: Path
) -> None:
    """A stored entry whose checksum matches but whose JPEG is damaged (written so)."""
    form = "jpeg:90"
    _fill(ds, cache_root, form)
    victim = ds.key(7)
    body = {k: np.array(v) for k, v in codec.decode(_stored(cache_root, form, victim)).items()}
    jpeg_name = next(k for k in body if k.startswith(_JPEG_PREFIX))
    body[jpeg_name] = body[jpeg_name][: len(body[jpeg_name]) // 3]  # truncated JPEG
    bad = codec.encode(body)
    unpacked = parse_disk_form(form).unpack(_stored(cache_root, form, ds.key(0)))
    with DiskStore(cache_root / "disk-jpeg90", capacity="64MiB") as disk:
        assert disk.put(victim, bad)
    with _cache(cache_root, form) as cache:
        reader = cache.reader
        assert reader is not None
        raw = codec.encode(ds.produce(0))
        layout = codec.read_header(raw)
        keys = np.frombuffer(ds.key(0) + victim + ds.key(1), dtype=np.uint8).reshape(3, 16)
        out = np.zeros((3, layout.length), dtype=np.uint8)
        found = reader.gather_ranges(keys, [(0, layout.length, out)])
        assert found.tolist() == [True, False, True]
        assert cache.stats()["disk"].corrupt == 1
        assert cache.disk is not None and not cache.disk.contains(victim)
        # The rows that were served are the raw entries' bytes (checksum aside).
        fields = codec.decode(unpacked)
        got = codec.decode(out[0].tobytes(), verify=False)
        for name, arr in fields.items():
            assert np.array_equal(got[name], arr), name


def test_a_form_without_write_ranges_does_not_gather(tmp_path: Path) -> None:
    class Plain:
        def pack(self, raw: bytes | memoryview) -> bytes:
            return bytes(raw)

        def unpack(self, stored: bytes | memoryview, *, limit: int | None = None) -> bytes:
            return bytes(stored)

    with FormedDiskStore(tmp_path / "d", form=Plain(), capacity="1MiB") as store:
        store.enable_gather(codec.checksum_matches)
        assert not store.supports_gather  # its hits stay with the cache's verified read
    with FormedDiskStore(tmp_path / "j", form=parse_disk_form("zstd"), capacity="1MiB") as store:
        store.enable_gather(codec.checksum_matches)
        assert store.supports_gather


def test_memory_quarter_and_a_jpeg_disk_tier_gather_the_workers_batches(
    ds: MultimodalDataset, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory (a quarter of the data, raw) over a jpeg:90 disk tier (all of it): rows from
    both tiers, in-process, equal the batches the disk tier alone gives."""
    form = "jpeg:90"
    _fill(ds, cache_root, form)
    alone, _ = _served(ds, cache_root, form, in_process=True)
    sample = len(codec.encode(ds.produce(0)))
    cache = Cache(
        cache_root,
        memory=12 * (sample + 256),
        disk="64MiB",
        disk_form=form,
        policy="keep",
        temporary=True,
    )
    try:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=0)
        _same(_epoch(loader, 1), alone)  # promotes what fits, in order
        ran = _spy_workers(monkeypatch, ds)
        _same(_epoch(loader, 1), alone)
        assert ran == []
        e = loader.stats().epochs[-1]  # epoch 1, both passes
        assert e.misses == 0 and e.tier_hits["memory"] >= 12 and e.tier_hits["disk"] >= 36
    finally:
        cache.close()
