"""``ImageSpec(channels_last=True)``: pixels cached interleaved ``[H, W, 3]``, presented as
``[B, 3, H, W]`` in torch's channels_last memory format with the same values as the default
planar layout, cached or not, any worker count, fixed or varied shapes, and augmented."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mmcache.augment import Compose, RandomHorizontalFlip, RandomResizedCrop
from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset, open_source
from mmcache.errors import ConfigError
from mmcache.loader import DataLoader
from mmcache.synth import make_dataset
from mmcache.transforms import ImageSpec
from mmcache.transforms.pipeline import Pipeline


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("cl") / "data", 20, seed=4)


def _epochs(loader: DataLoader, n: int) -> list[list[dict[str, Any]]]:
    out = []
    for e in range(n):
        loader.set_epoch(e)
        out.append(list(loader))
    return out


@pytest.mark.parametrize("crop", ["center", None])
def test_interleaved_cache_gives_the_planar_values_in_channels_last_strides(
    data: Path, cache_root: Path, crop: str | None
) -> None:
    planar = MultimodalDataset(data, pipeline=Pipeline(image=ImageSpec(size=32, crop=crop)))
    spec = ImageSpec(size=32, crop=crop, channels_last=True)
    inter = MultimodalDataset(data, pipeline=Pipeline(image=spec))
    assert spec.fingerprint() != ImageSpec(size=32, crop=crop).fingerprint()
    assert inter.pipeline.channels_last_fields == {"image"}
    assert inter.produce(0)["image"].shape[-1] == 3  # cached as [H, W, 3]
    item = inter[0]
    assert item is not None and torch.equal(item["image"], planar[0]["image"])  # type: ignore[index]
    ref = _epochs(DataLoader(planar, cache=None, batch_size=6, seed=3), 2)
    with Cache(cache_root, memory="16MiB", disk=None, temporary=True) as cache:
        for workers in (0, 2):
            loader = DataLoader(inter, cache=cache, batch_size=6, seed=3, num_workers=workers)
            for got_epoch, want_epoch in zip(_epochs(loader, 2), ref, strict=True):
                for got, want in zip(got_epoch, want_epoch, strict=True):
                    assert got["id"] == want["id"]
                    if crop is None:
                        assert torch.equal(got["image_sizes"], want["image_sizes"])
                        for a, b in zip(got["image"], want["image"], strict=True):
                            assert a.shape == b.shape and torch.equal(a, b)
                            assert a.stride(0) == 1  # a view of interleaved pixels
                    else:
                        img = got["image"]
                        assert img.shape == want["image"].shape and torch.equal(img, want["image"])
                        assert img.is_contiguous(memory_format=torch.channels_last)
        assert loader.stats().epochs[-1].misses == 0


def test_augmented_batches_are_the_same_from_either_layout(data: Path) -> None:
    aug = Compose([RandomResizedCrop(24, scale=(0.5, 1.0)), RandomHorizontalFlip()])
    batches = {}
    for layout in (False, True):
        spec = ImageSpec(size=32, crop=None, channels_last=layout)
        ds = MultimodalDataset(data, pipeline=Pipeline(image=spec))
        batches[layout] = list(DataLoader(ds, cache=None, batch_size=5, seed=1, augment=aug))
    for a, b in zip(batches[False], batches[True], strict=True):
        assert torch.equal(a["image"], b["image"])
        assert b["image"].is_contiguous(memory_format=torch.channels_last)


def test_channels_last_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="channels_last must be a bool"):
        ImageSpec(channels_last=1)  # type: ignore[arg-type]


def test_a_parquet_source_presents_interleaved_pixels_as_planar_values(
    data: Path, tmp_path: Path
) -> None:
    from mmcache.testing.tabular import write_parquet

    table = write_parquet(data, tmp_path / "t")[0]
    planar = open_source(table, pipeline=Pipeline(image=ImageSpec(size=32)))
    inter = open_source(table, pipeline=Pipeline(image=ImageSpec(size=32, channels_last=True)))
    assert inter.channels_last_fields == {"image"}
    assert torch.equal(inter[3]["image"], planar[3]["image"])  # type: ignore[index]
    a = next(iter(DataLoader(planar, cache=None, batch_size=4)))
    b = next(iter(DataLoader(inter, cache=None, batch_size=4)))
    assert torch.equal(a["image"], b["image"])
