"""What a second pass over the loader means, and its record in ``stats()``.

A ``for`` after a finished epoch without ``set_epoch`` is the next epoch (the
order ``set_epoch(epoch + 1)`` gives); iterating an epoch again is a pass of its
own with its own record, never added to the first pass's counts.
"""

from __future__ import annotations

from pathlib import Path

from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.transforms.pipeline import Pipeline

BATCH = 10  # 48 samples: 5 batches per epoch, the last of 8


def _ids(loader: DataLoader) -> list[list[str]]:
    return [list(b["id"]) for b in loader]


def test_each_pass_has_its_own_record(tiny_data: Path, small_pipeline: Pipeline) -> None:
    ds = MultimodalDataset(tiny_data, pipeline=small_pipeline)
    loader = DataLoader(ds, cache=None, batch_size=BATCH, seed=3)
    first = _ids(loader)
    second = _ids(loader)  # no set_epoch: the next epoch
    loader.set_epoch(1)
    replay = _ids(loader)  # epoch 1 again
    loader.set_epoch(0)
    again = _ids(loader)

    reference = DataLoader(ds, cache=None, batch_size=BATCH, seed=3)
    reference.set_epoch(1)
    assert second == replay == _ids(reference) != first
    assert again == first
    records = loader.stats().epochs
    assert [(r.epoch, r.samples, r.batches) for r in records] == [
        (0, 48, 5),
        (1, 48, 5),
        (1, 48, 5),
        (0, 48, 5),
    ]
    assert loader.stats().misses == 4 * 48


def test_a_pass_that_left_early_goes_on_in_its_own_record(
    tiny_data: Path, small_pipeline: Pipeline
) -> None:
    ds = MultimodalDataset(tiny_data, pipeline=small_pipeline)
    loader = DataLoader(ds, cache=None, batch_size=BATCH, seed=3)
    for k, _batch in enumerate(loader):
        if k == 1:
            break  # two batches of epoch 0
    assert [(r.epoch, r.samples) for r in loader.stats().epochs] == [(0, 20)]
    rest = _ids(loader)  # no set_epoch: the rest of epoch 0
    assert len(rest) == 3
    assert [(r.epoch, r.samples, r.batches) for r in loader.stats().epochs] == [(0, 48, 5)]
    _ids(loader)  # then epoch 1
    assert [(r.epoch, r.samples) for r in loader.stats().epochs] == [(0, 48), (1, 48)]
