"""SFT batches: padding values, images of one or several shapes, multi-image and text-only
samples in one batch, fully masked samples refused, cold == warm, 0 == 2 workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmcache import Cache, DataLoader, SampleError
from mmcache.errors import ConfigError
from mmcache.loader import SFTBatching
from mmcache.testing.sft import SyntheticSFTSource


def _batches(loader: DataLoader, epoch: int = 0) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return list(loader)


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for name, x in a.items():
        y = b[name]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        elif isinstance(x, list) and x and isinstance(x[0], torch.Tensor):
            assert len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y, strict=True))
        else:
            assert x == y, name


def test_padding_values_and_attention_mask_match_each_sample() -> None:
    src = SyntheticSFTSource(10, seed=2, pad_token_id=7)
    loader = DataLoader(src, cache=None, batch_size=5, shuffle=False)
    for batch in loader:
        ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
        assert ids.dtype == labels.dtype == mask.dtype == torch.int64
        width = ids.shape[1]
        assert width % 8 == 0  # pad_to_multiple_of=8 by default
        for r, sid in enumerate(batch["id"]):
            sample = src.produce(int(sid.split("-")[1]))
            n = len(sample["input_ids"])
            assert width - 8 < max(int(m.sum()) for m in mask) <= width
            assert ids[r, :n].tolist() == sample["input_ids"].tolist()
            assert labels[r, :n].tolist() == sample["labels"].tolist()
            assert (ids[r, n:] == 7).all() and (labels[r, n:] == -100).all()
            assert mask[r, :n].all() and not mask[r, n:].any()


def test_pad_options_pad_id_and_multiple() -> None:
    src = SyntheticSFTSource(6, seed=3)
    exact = SFTBatching(pad_token_id=1, pad_to_multiple_of=1)
    loader = DataLoader(src, cache=None, batch_size=6, shuffle=False, batching=exact)
    (batch,) = list(loader)
    longest = int(src.lengths().max())
    assert batch["input_ids"].shape == (6, longest)  # exactly the longest row
    short = int(np.argmin(src.lengths()))
    assert batch["input_ids"][short, -1] == 1
    with pytest.raises(ConfigError, match="pad_to_multiple_of"):
        DataLoader(src, cache=None, batch_size=2, batching=SFTBatching(pad_to_multiple_of=0))


def test_multi_image_and_text_only_samples_in_one_batch() -> None:
    # Samples cycle through 1, 0 and 2 images; shapes alternate between two sizes.
    src = SyntheticSFTSource(3, seed=4, image_counts=(1, 0, 2), shapes=((16, 16), (8, 12)))
    (batch,) = list(DataLoader(src, cache=None, batch_size=3, shuffle=False))
    assert batch["image_counts"].tolist() == [1, 0, 2]
    images = batch["images"]
    assert isinstance(images, list) and len(images) == 3  # two shapes: a list
    assert batch["image_sizes"].tolist() == [[16, 16], [8, 12], [16, 16]]
    assert batch["image_sizes"].dtype == torch.int64
    for k, (im, (h, w)) in enumerate(zip(images, batch["image_sizes"].tolist(), strict=True)):
        assert im.dtype == torch.uint8 and tuple(im.shape) == (3, h, w), k
    # The images are the samples' own bytes, in row order.
    flat = np.concatenate([src.produce(0)["images"], src.produce(2)["images"]])
    assert np.array_equal(np.concatenate([im.numpy().reshape(-1) for im in images]), flat)


def test_images_of_one_shape_are_one_tensor() -> None:
    src = SyntheticSFTSource(4, seed=5, image_counts=(1, 2), shapes=((16, 24),))
    (batch,) = list(DataLoader(src, cache=None, batch_size=4, shuffle=False))
    assert isinstance(batch["images"], torch.Tensor)
    assert batch["images"].shape == (6, 3, 16, 24) and batch["images"].dtype == torch.uint8
    assert batch["image_counts"].tolist() == [1, 2, 1, 2]


def test_a_text_only_batch_has_no_images_but_counts() -> None:
    src = SyntheticSFTSource(4, seed=6, image_counts=(0,))
    (batch,) = list(DataLoader(src, cache=None, batch_size=4, shuffle=False))
    assert batch["image_counts"].tolist() == [0, 0, 0, 0]
    assert batch["image_sizes"].shape == (0, 2)


def test_fully_masked_samples_never_reach_the_batch(cache_root: Path) -> None:
    src = SyntheticSFTSource(12, seed=7, masked=(3, 8), on_error="skip")
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(src, cache=cache, batch_size=4, shuffle=False)
        for epoch in range(2):  # cold, then warm
            seen = [sid for b in _batches(loader, epoch) for sid in b["id"]]
            assert "sft-000003" not in seen and "sft-000008" not in seen
            assert len(seen) == 10
            for b in _batches(loader, epoch):
                assert ((b["labels"] != -100).sum(dim=1) > 0).all()
    assert {r.sample_id for r in src.rejects()} == {"sft-000003", "sft-000008"}
    strict = SyntheticSFTSource(12, seed=7, masked=(3,))
    with pytest.raises(SampleError, match=r"sft-000003.*fully masked|fully masked.*sft-000003"):
        list(DataLoader(strict, cache=None, batch_size=4, shuffle=False))


class _MaskingSource(SyntheticSFTSource):
    """A source that does not refuse fully masked samples: the loader still does."""

    def produce(self, index: int) -> dict[str, np.ndarray]:
        out = super().produce(index)
        if index == 1:
            out["labels"][:] = -100
        return out


def test_the_loader_refuses_fully_masked_rows_a_source_lets_through() -> None:
    with pytest.raises(SampleError, match="every label is -100"):
        list(DataLoader(_MaskingSource(4, seed=8), cache=None, batch_size=4, shuffle=False))
    src = _MaskingSource(4, seed=8, on_error="skip")
    (batch,) = list(DataLoader(src, cache=None, batch_size=4, shuffle=False))
    assert batch["id"] == ["sft-000000", "sft-000002", "sft-000003"]
    assert batch["input_ids"].shape[0] == 3 and batch["image_counts"].tolist() == [1, 2, 1]
    assert [r.sample_id for r in src.rejects()] == ["sft-000001"]


def test_cold_warm_and_uncached_batches_are_bitwise_equal(cache_root: Path) -> None:
    src = SyntheticSFTSource(24, seed=9)
    plain = _batches(DataLoader(src, cache=None, batch_size=5, seed=1))
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(src, cache=cache, batch_size=5, seed=1)
        cold = _batches(loader)
        warm = _batches(loader)
        assert loader.stats().epochs[-1].hits == 24  # the warm epoch came from memory
    for a, b, c in zip(plain, cold, warm, strict=True):
        _same(
            {k: v for k, v in a.items() if k != "key"}, {k: v for k, v in b.items() if k != "key"}
        )
        _same(b, c)


def test_zero_and_two_workers_give_the_same_batches(cache_root: Path) -> None:
    src = SyntheticSFTSource(20, seed=10)
    zero = _batches(DataLoader(src, cache=None, batch_size=4, seed=2))
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(src, cache=cache, batch_size=4, seed=2, num_workers=2)
        cold = _batches(loader)  # misses produced by the workers
        warm = _batches(loader)  # hits gathered here
        assert loader.stats().epochs[-1].hits == 20
        loader.close()
    assert len(zero) == len(cold) == len(warm) == 5
    for a, b, c in zip(zero, cold, warm, strict=True):
        _same(
            {k: v for k, v in a.items() if k != "key"}, {k: v for k, v in b.items() if k != "key"}
        )
        _same(b, c)
