"""Cache(disk_form=...): compact forms of the disk tier (issue 17, section 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmcache import codec
from mmcache.cache import Cache
from mmcache.codec.compact import DiskForm, jpeg_backend, parse_disk_form
from mmcache.dataset import MultimodalDataset
from mmcache.errors import ConfigError, CorruptEntryError
from mmcache.loader import DataLoader
from mmcache.stores.disk.formed import FormedDiskStore
from mmcache.transforms.pipeline import Pipeline

#: The documented bound of the jpeg:90 form on the synthetic set (README: measured ~35 dB).
JPEG90_MIN_PSNR = 30.0


def _epoch(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return list(loader)


@pytest.fixture
def ds(tiny_data: Path, small_pipeline: Pipeline) -> MultimodalDataset:
    return MultimodalDataset(tiny_data, pipeline=small_pipeline)


@pytest.fixture
def reference(ds: MultimodalDataset) -> list[list[dict[str, Any]]]:
    loader = DataLoader(ds, cache=None, batch_size=10, seed=3)
    return [_epoch(loader, 0), _epoch(loader, 1)]


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.double() - b.double()) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def _run_from_disk(ds: MultimodalDataset, root: Path, form: str) -> list[dict[str, Any]]:
    """Epoch 0 fills the disk tier; a new run serves epoch 1 from it alone."""
    with Cache(root, memory=0, disk="64MiB", disk_form=form) as cache:
        _epoch(DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=2), 0)
    with Cache(root, memory=0, disk="64MiB", disk_form=form) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=10, seed=3, num_workers=2)
        out = _epoch(loader, 1)
        e = loader.stats().epochs[0]
        assert e.misses == 0 and e.tier_hits == {"disk": 48}
    return out


@pytest.mark.parametrize("form", ["raw", "zstd"])
def test_lossless_forms_give_bitwise_the_uncached_batches(
    ds: MultimodalDataset, reference: list[list[dict[str, Any]]], cache_root: Path, form: str
) -> None:
    got = _run_from_disk(ds, cache_root, form)
    for x, y in zip(got, reference[1], strict=True):
        assert x["id"] == y["id"]
        for name in ("image", "input_ids", "attention_mask"):
            assert torch.equal(x[name], y[name]), name
    folder = cache_root / ("disk" if form == "raw" else f"disk-{form}")
    assert (folder / "data.mdb").exists()


def test_jpeg_form_is_within_its_bound_identical_across_runs_and_smaller(
    ds: MultimodalDataset, reference: list[list[dict[str, Any]]], cache_root: Path, tmp_path: Path
) -> None:
    first = _run_from_disk(ds, cache_root, "jpeg:90")
    again = _run_from_disk(ds, tmp_path / "again", "jpeg:90")
    for x, y, z in zip(first, reference[1], again, strict=True):
        assert x["id"] == y["id"]
        assert torch.equal(x["input_ids"], y["input_ids"])  # only images are re-encoded
        assert torch.equal(x["attention_mask"], y["attention_mask"])
        assert x["image"].shape == y["image"].shape and x["image"].dtype == torch.uint8
        assert _psnr(x["image"], y["image"]) >= JPEG90_MIN_PSNR
        assert torch.equal(x["image"], z["image"])  # deterministic decode
    with (
        Cache(cache_root, memory=0, disk="64MiB", disk_form="jpeg:90") as jpeg,
        Cache(tmp_path / "raw", memory=0, disk="64MiB") as raw,
    ):
        for i in range(len(ds)):
            raw.put(ds.key(i), ds.produce(i))
        assert jpeg.disk is not None and raw.disk is not None
        assert jpeg.disk.nbytes() * 2 < raw.disk.nbytes()  # 64 px noise: >= 2x here


def test_forms_never_mix(ds: MultimodalDataset, cache_root: Path) -> None:
    with Cache(cache_root, memory=0, disk="64MiB") as raw:
        raw.put(ds.key(0), ds.produce(0))
    with Cache(cache_root, memory=0, disk="64MiB", disk_form="jpeg:90") as jpeg:
        assert jpeg.get(ds.key(0)) is None  # the raw entry is not this form's
        jpeg.put(ds.key(1), ds.produce(1))
        assert isinstance(jpeg.disk, FormedDiskStore)
    with Cache(cache_root, memory=0, disk="64MiB") as raw:
        assert raw.get(ds.key(1)) is None  # a lossy entry never reaches a raw cache
        assert raw.get(ds.key(0)) is not None


def test_pack_unpack_and_damage(ds: MultimodalDataset) -> None:
    raw = codec.encode(ds.produce(0), ctime=12.5, cost=0.25)
    assert parse_disk_form("zstd").unpack(parse_disk_form("zstd").pack(raw)) == raw
    form = parse_disk_form("jpeg:75")
    assert form == DiskForm("jpeg", 75) and form.tag == "jpeg75" and not form.lossless
    back = form.unpack(form.pack(raw))
    assert codec.verify(back)
    h = codec.read_header(back)
    assert (h.ctime, h.cost) == (12.5, 0.25)
    assert [f.name for f in h.fields] == [f.name for f in codec.read_header(raw).fields]
    packed = bytearray(form.pack(raw))
    packed[len(packed) // 2] ^= 0x40
    with pytest.raises(CorruptEntryError):
        form.unpack(bytes(packed))
    for bad in ("jpeg", "jpeg:0", "jpeg:101", "lz4", ""):
        with pytest.raises(ConfigError):
            parse_disk_form(bad)
    assert jpeg_backend() in ("simplejpeg", "pillow")


def test_a_damaged_compact_entry_is_dropped_and_produced_again(
    ds: MultimodalDataset, cache_root: Path
) -> None:
    with Cache(cache_root, memory=0, disk="64MiB", disk_form="zstd") as cache:
        cache.put(ds.key(0), ds.produce(0))
        disk = cache.disk
        assert isinstance(disk, FormedDiskStore)
        stored = bytearray(disk.form.pack(codec.encode(ds.produce(0))))
        stored[-50] ^= 0x01
        # Write the damaged bytes under the key, bypassing the form.
        super(FormedDiskStore, disk).put_many([(ds.key(0), bytes(stored), 0.0, 0.0)])
        assert cache.get(ds.key(0)) is None
        assert cache.stats()["disk"].corrupt == 1
        sample = cache.get_or_produce(ds.key(0), lambda: ds.produce(0))
        assert np.array_equal(sample["image"], ds.produce(0)["image"])


def test_the_form_is_recorded_so_stats_verify_and_gc_open_its_folder(
    ds: MultimodalDataset, cache_root: Path
) -> None:
    with Cache(cache_root, memory=0, disk="64MiB", disk_form="zstd") as cache:
        cache.put(ds.key(0), ds.produce(0))
    inspected = Cache.open_existing(cache_root, memory=0)
    try:
        assert str(inspected.disk_form) == "zstd" and isinstance(inspected.disk, FormedDiskStore)
        assert inspected.get(ds.key(0)) is not None
        assert inspected.verify().checked == 1
    finally:
        inspected.close()
    config = cache_root / "cache.json"
    recorded = json.loads(config.read_text())
    config.write_text(json.dumps({**recorded, "disk_form": "jpeg:0"}))
    with pytest.raises(ConfigError, match="disk_form"):
        Cache.open_existing(cache_root, memory=0)
