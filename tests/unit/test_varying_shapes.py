"""Cached images of varied shapes (aspect ratio kept): batches hold a list of images and
their ``image_sizes``, or one tensor once an augment makes them one size."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from PIL import Image

from mmcache.augment import Compose, RandomHorizontalFlip, RandomResizedCrop
from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.synth import make_dataset
from mmcache.transforms import TextSpec
from mmcache.transforms.pipeline import Pipeline


class KeepAspect:
    """An image stage: shorter side to 24, aspect ratio kept (longer side up to 64)."""

    kind: ClassVar[str] = "image"
    fixed_shape = False

    def fingerprint(self) -> str:
        return "keep-aspect-24-64"

    def __call__(self, im: Image.Image, /) -> np.ndarray:
        im = im.convert("RGB")
        w, h = im.size
        s = 24 / min(w, h)
        size = (min(64, max(1, round(w * s))), min(64, max(1, round(h * s))))
        return np.asarray(im.resize(size, Image.BILINEAR)).transpose(2, 0, 1).copy()


@pytest.fixture
def ds(tmp_path: Path, tokenizer_json: Path) -> MultimodalDataset:
    pipe = Pipeline(image=KeepAspect(), text=TextSpec(tokenizer_json, max_length=16))  # type: ignore[arg-type]
    return MultimodalDataset(make_dataset(tmp_path / "data", 30, seed=2), pipeline=pipe)


def _epoch(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return list(loader)


def _same_lists(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        assert x["id"] == y["id"]
        assert isinstance(x["image"], list) and len(x["image"]) == len(x["id"])
        assert all(torch.equal(a, b) for a, b in zip(x["image"], y["image"], strict=True))
        assert torch.equal(x["image_sizes"], y["image_sizes"])
        assert torch.equal(x["input_ids"], y["input_ids"])


def test_batches_of_varied_shapes_are_lists_with_image_sizes_cached_or_not(
    ds: MultimodalDataset, cache_root: Path
) -> None:
    assert ds.varying_fields == {"image"}
    ref_loader = DataLoader(ds, cache=None, batch_size=7, seed=1)
    ref = {e: _epoch(ref_loader, e) for e in range(3)}
    shapes = {tuple(t.shape) for b in ref[0] for t in b["image"]}
    assert len(shapes) > 3  # the synthetic images have several aspect ratios
    index = {ds.sample_id(i): i for i in range(len(ds))}
    for b in ref[0]:
        assert b["image_sizes"].dtype == torch.int64 and b["image_sizes"].shape == (len(b["id"]), 2)
        for t, (h, w), i in zip(b["image"], b["image_sizes"].tolist(), b["id"], strict=True):
            assert t.shape == (3, h, w) and min(h, w) == 24
            assert torch.equal(t, torch.from_numpy(ds.produce(index[i])["image"]))
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(
            ds, cache=cache, batch_size=7, seed=1, num_workers=2, persistent_workers=True
        )
        for e in range(3):  # cold (workers), warm planned, warm guessed
            _same_lists(_epoch(loader, e), ref[e])
        assert loader.stats().epochs[-1].hits == 30
        assert 2 in loader._warm.guessed  # epoch 2 gathered from learnt keys
        assert loader.stats().epochs[1].late_misses == 0  # other shapes read as hits
        assert cache.stats()["memory"].corrupt == 0  # other shapes are not damage
        loader.close()
        fresh = DataLoader(ds, cache=cache, batch_size=7, seed=1)  # learns a layout anew
        _same_lists(_epoch(fresh, 1), ref[1])
        assert fresh.stats().epochs[-1].hits == 30


def test_an_augment_of_fixed_size_makes_varied_shapes_one_tensor(
    ds: MultimodalDataset, cache_root: Path
) -> None:
    aug = Compose([RandomResizedCrop(32, scale=(0.5, 1.0)), RandomHorizontalFlip()])
    ref = _epoch(DataLoader(ds, cache=None, batch_size=7, seed=1, augment=aug), 1)
    flips = _epoch(
        DataLoader(ds, cache=None, batch_size=7, seed=1, augment=RandomHorizontalFlip(1.0)), 1
    )
    plain = _epoch(DataLoader(ds, cache=None, batch_size=7, seed=1), 1)
    for f, p in zip(flips, plain, strict=True):  # a list stays a list, with its sizes
        assert all(torch.equal(a, b.flip(-1)) for a, b in zip(f["image"], p["image"], strict=True))
        assert torch.equal(f["image_sizes"], p["image_sizes"])
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=7, seed=1, num_workers=2, augment=aug)
        _epoch(loader, 0)
        got = _epoch(loader, 1)
        loader.close()
    for x, y in zip(got, ref, strict=True):
        assert isinstance(x["image"], torch.Tensor) and x["image"].shape == (
            len(x["id"]),
            3,
            32,
            32,
        )
        assert "image_sizes" not in x
        assert x["id"] == y["id"] and torch.equal(x["image"], y["image"])


def test_imagespec_without_crop_gives_list_batches(tmp_path: Path, tokenizer_json: Path) -> None:
    """``ImageSpec(crop=None)`` keeps each aspect ratio: the loader batches a list plus
    ``image_sizes``, warm epochs included; a square padding makes the shapes one again."""
    from mmcache.transforms import ImageSpec

    manifest = make_dataset(tmp_path / "data", 20, seed=3)
    text = TextSpec(tokenizer_json, max_length=8)
    ds = MultimodalDataset(
        manifest, pipeline=Pipeline(image=ImageSpec(size=24, crop=None, max_size=48), text=text)
    )
    with Cache(tmp_path / "c", memory="64MiB", temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=8, seed=1)
        cold, warm = _epoch(loader, 0), _epoch(loader, 0)
        _same_lists(warm, cold)
        shapes = {tuple(img.shape) for b in cold for img in b["image"]}
        assert len(shapes) > 1 and all(min(s[1:]) == 24 and max(s[1:]) <= 48 for s in shapes)
        assert [tuple(t.shape[1:]) for t in cold[0]["image"]] == [
            tuple(x) for x in cold[0]["image_sizes"].tolist()
        ]
    square = Pipeline(image=ImageSpec(size=24, crop=None, pad_to_square=True), text=text)
    batch = next(
        iter(DataLoader(MultimodalDataset(manifest, pipeline=square), cache=None, batch_size=8))
    )
    assert isinstance(batch["image"], torch.Tensor) and batch["image"].shape[1:] == (3, 24, 24)
