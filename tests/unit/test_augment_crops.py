"""The loader's CPU crops run in crop processes beside its workers (issue 28).

The promise: with workers, the training process does not crop (here: cropping
there raises), and the batches are bitwise the ones cropped in the training
process with the cache off, cold, warm (guessed), with 0 or 2 workers, on resume,
and when a crop process dies mid-epoch.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from loader_support import epoch_batches

from mmcache.augment import (
    ColorJitter,
    Compose,
    Normalize,
    RandomGrayscale,
    RandomHorizontalFlip,
    RandomResizedCrop,
)
from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.loader.augmenting import AugmentHook
from mmcache.loader.croppool import poolable
from mmcache.synth import make_dataset
from mmcache.transforms import ImageSpec
from mmcache.transforms.pipeline import Pipeline

AUG = Compose([RandomResizedCrop(48, scale=(0.3, 1.0)), RandomHorizontalFlip()])
COLOUR = Compose(
    [
        RandomResizedCrop(48, scale=(0.3, 1.0), interpolation="bicubic"),
        ColorJitter(0.4, 0.4, 0.4, 0.1),
        RandomGrayscale(0.3),
        Normalize("clip"),
    ]
)


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        assert x["id"] == y["id"]
        assert x["image"].shape == y["image"].shape and x["image"].dtype == y["image"].dtype
        assert x["image"].stride() == y["image"].stride()
        assert torch.equal(x["image"], y["image"])


def _loader(ds: MultimodalDataset, cache: Cache, augment: Any = AUG, **kw: Any) -> DataLoader:
    return DataLoader(ds, cache=cache, batch_size=8, seed=5, num_workers=2, augment=augment, **kw)


def _hook(loader: DataLoader) -> AugmentHook:
    return next(h for h in loader._hooks_closing)


@pytest.fixture(params=[False, True], ids=["planar", "channels_last"])
def ds(request: pytest.FixtureRequest, tmp_path: Path) -> MultimodalDataset:
    pipeline = Pipeline(image=ImageSpec(size=64, channels_last=request.param))
    return MultimodalDataset(make_dataset(tmp_path / "data", 40, seed=4), pipeline=pipeline)


@pytest.fixture
def reference(ds: MultimodalDataset) -> dict[int, list[dict[str, Any]]]:
    loader = DataLoader(ds, cache=None, batch_size=8, seed=5, augment=AUG)
    return {e: epoch_batches(loader, e) for e in range(3)}


def _count_crops_here(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on each crop of a batch in this (the training) process is counted; the
    crop processes, forked before, are not. (Every crop of a batch draws its boxes once,
    called or fused with the flips after it.)"""
    calls = [0]
    boxes = RandomResizedCrop._boxes

    def counted(self: RandomResizedCrop, *args: Any) -> Any:
        calls[0] += 1
        return boxes(self, *args)

    monkeypatch.setattr(RandomResizedCrop, "_boxes", counted)
    return calls


@pytest.mark.parametrize("augment", [AUG, COLOUR], ids=["crop_flip", "crop_colour_normalize"])
def test_with_workers_the_training_process_crops_one_batch_and_all_are_bitwise_the_same(
    ds: MultimodalDataset, cache_root: Path, monkeypatch: pytest.MonkeyPatch, augment: Any
) -> None:
    reference = DataLoader(ds, cache=None, batch_size=8, seed=5, augment=augment)
    want = {e: epoch_batches(reference, e) for e in range(3)}
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = _loader(ds, cache, augment, persistent_workers=True)
        here = _count_crops_here(monkeypatch)
        for e in range(3):  # cold, then warm epochs guessed from learnt keys
            _same(epoch_batches(loader, e), want[e])
        assert loader.stats().epochs[-1].hits == 40
        # Of 15 batches, the first is cropped here (it shows the output's form), the
        # other 14 in the crop processes.
        assert here[0] == 1
        loader.close()
        monkeypatch.undo()
        alone = DataLoader(ds, cache=cache, batch_size=8, seed=5, num_workers=0, augment=augment)
        _same(epoch_batches(alone, 2), want[2])  # no workers: cropped here, the same


def test_resume_mid_epoch_with_crop_processes_gives_the_same_batches(
    ds: MultimodalDataset,
    reference: dict[int, list[dict[str, Any]]],
    cache_root: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        epoch_batches(DataLoader(ds, cache=cache, batch_size=8, seed=5), 0)  # warms the cache
        loader, again = _loader(ds, cache), _loader(ds, cache)
        here = _count_crops_here(monkeypatch)
        loader.set_epoch(1)
        it = iter(loader)
        first = [next(it), next(it)]
        state = loader.state_dict()
        del it
        loader.close()
        again.load_state_dict(state)
        again.set_epoch(1)
        _same(first + list(again), reference[1])
        assert here[0] == 2  # one batch here per loader; the other 3 + 2 in crop processes
        again.close()


def test_a_killed_crop_process_costs_no_batch(
    ds: MultimodalDataset, reference: dict[int, list[dict[str, Any]]], cache_root: Path
) -> None:
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = _loader(ds, cache)
        _same(epoch_batches(loader, 0), reference[0])
        crops = _hook(loader)._crops
        assert crops is not None and crops.processes == 2
        os.kill(crops._procs[0].pid, signal.SIGKILL)
        crops._procs[0].join(10)
        _same(epoch_batches(loader, 1), reference[1])  # cropped here from the failed batch on
        loader.close()


def test_only_cpu_crops_and_flips_go_to_crop_processes() -> None:
    assert poolable(AUG) and poolable(RandomResizedCrop(8))
    assert poolable(COLOUR) and not poolable(RandomHorizontalFlip())
    assert not poolable(Compose([RandomHorizontalFlip(), RandomResizedCrop(8)]))
    assert not poolable(lambda images, generator: images)
