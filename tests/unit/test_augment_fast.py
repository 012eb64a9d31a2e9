"""The CPU crops' cheaper forms give bitwise the batches of the plain forms (issue 28).

The crops draw their ten tries at once, resize straight into the batch's rows (fused
with the flips after them), and a crop process seeds its generators again instead of
making new ones. Each is pinned here against the plain form written out in this file:
torchvision's ``get_params`` one draw at a time, ``F.interpolate`` of each crop copied
into a new batch, ``torch.rand(1) < p`` and ``flip`` per image.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmcache.augment import (
    ColorJitter,
    Compose,
    RandomHorizontalFlip,
    RandomResizedCrop,
    augment_into,
    reseed_generators,
    sample_generators,
    sample_seed,
)


def _plain_params(
    crop: RandomResizedCrop, height: int, width: int, g: torch.Generator
) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``, one draw at a time."""
    area = height * width
    log_ratio = (math.log(crop.ratio[0]), math.log(crop.ratio[1]))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(*crop.scale, generator=g).item()
        aspect = math.exp(torch.empty(1).uniform_(*log_ratio, generator=g).item())
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=g).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=g).item())
            return top, left, h, w
    # The centre crop, clipped to the image (torchvision's fallback).
    narrowest, widest = min(crop.ratio), max(crop.ratio)
    w, h = width, height
    if width / height < narrowest:
        h = round(width / narrowest)
    elif width / height > widest:
        w = round(height * widest)
    return (height - h) // 2, (width - w) // 2, h, w


def _plain(augment: Any, images: Any, gens: list[torch.Generator]) -> torch.Tensor:
    """A crop then flips, the plain way: every crop's draws, then each flip's."""
    crop, *flips = augment.transforms if isinstance(augment, Compose) else [augment]
    seq = list(images)
    boxes = [
        _plain_params(crop, im.shape[1], im.shape[2], g) for im, g in zip(seq, gens, strict=True)
    ]
    rows = []
    for im, (top, left, h, w) in zip(seq, boxes, strict=True):
        piece = im[:, top : top + h, left : left + w].unsqueeze(0)
        piece = piece.contiguous(memory_format=torch.channels_last)
        rows.append(
            F.interpolate(
                piece,
                size=(crop.size, crop.size),
                mode=crop.interpolation,
                align_corners=False,
                antialias=crop.antialias,
            )[0]
        )
    for f in flips:
        drawn = [torch.rand(1, generator=g).item() < f.p for g in gens]
        rows = [r.flip(-1) if d else r for r, d in zip(rows, drawn, strict=True)]
    return torch.stack(rows)


def _images(n: int, h: int, w: int, channels_last: bool, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, generator=g)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def _states(gens: list[torch.Generator]) -> list[torch.Tensor]:
    return [g.get_state() for g in gens]


def test_the_seeds_are_sample_seed_for_every_kind_of_index() -> None:
    indices: list[int] = [0, 1, 7, 2**31, 2**62, 12345678901, 2**63 - 1, -1, -(2**40)]
    for seed in (0, 5, -3, 2**40 + 1):
        for epoch in (0, 1, 999):
            want = [sample_seed(seed, epoch, i) for i in indices]
            for given in (indices, np.asarray(indices, dtype=np.int64)):
                assert [g.initial_seed() for g in sample_generators(seed, epoch, given)] == want
    beyond = [2**64 + 5, 2**70]  # beyond int64: still the pure function's seeds
    got = [g.initial_seed() for g in sample_generators(1, 2, beyond)]
    assert got == [sample_seed(1, 2, i) for i in beyond]
    assert [g.initial_seed() for g in sample_generators(1, 2, range(3))] == [
        sample_seed(1, 2, i) for i in range(3)
    ]


def test_reseeded_generators_draw_as_new_ones() -> None:
    kept: list[torch.Generator] = []
    for epoch, n in ((0, 4), (1, 6), (2, 3)):
        gens = reseed_generators(kept, 9, epoch, range(10, 10 + n))
        assert len(gens) == n and len(kept) >= n
        fresh = sample_generators(9, epoch, range(10, 10 + n))
        for g, f in zip(gens, fresh, strict=True):
            assert torch.equal(torch.rand(5, generator=g), torch.rand(5, generator=f))
            torch.randn(3, generator=g)  # a normal sample left cached must not carry over


@pytest.mark.parametrize(
    "crop",
    [
        RandomResizedCrop(224, scale=(0.9, 1.0)),
        RandomResizedCrop(32),
        RandomResizedCrop(32, scale=(0.5, 1.0), ratio=(0.2, 5.0)),
        RandomResizedCrop(32, scale=(1.0, 1.0), ratio=(2.0, 3.0)),
    ],
    ids=["bench", "default", "wide_ratio", "fallback"],
)
def test_the_boxes_and_the_generators_after_are_the_one_by_one_draws(
    crop: RandomResizedCrop,
) -> None:
    shapes = [(256, 256), (64, 80), (20, 90), (90, 20), (1, 1), (7, 300)]
    for h, w in shapes:
        gens = sample_generators(4, 1, range(400))
        plain = sample_generators(4, 1, range(400))
        got = [crop.params(h, w, g) for g in gens]
        want = [_plain_params(crop, h, w, g) for g in plain]
        assert got == want
        for a, b in zip(_states(gens), _states(plain), strict=True):
            assert torch.equal(a, b)  # the next draw (a flip's) is the same too


def test_a_crop_takes_at_most_three_draw_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    # One call per draw (~11 an image at scale (0.9, 1)) cost ~3 us each.
    calls = [0]
    uniform = torch.Tensor.uniform_

    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return uniform(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "uniform_", counted)
    crop = RandomResizedCrop(224, scale=(0.9, 1.0))
    images = _images(16, 256, 256, True)
    crop(images, sample_generators(0, 0, range(16)))
    assert calls[0] <= 3 * 16


AUGMENTS = {
    "bilinear_flip": Compose([RandomResizedCrop(40, scale=(0.3, 1.0)), RandomHorizontalFlip()]),
    "bicubic_two_flips": Compose(
        [
            RandomResizedCrop(40, interpolation="bicubic"),
            RandomHorizontalFlip(0.3),
            RandomHorizontalFlip(0.8),
        ]
    ),
    "plain_bilinear": RandomResizedCrop(40, scale=(0.3, 1.0), antialias=False),
    "plain_bicubic_flip": Compose(
        [RandomResizedCrop(40, interpolation="bicubic", antialias=False), RandomHorizontalFlip()]
    ),
}


@pytest.mark.parametrize("channels_last", [False, True], ids=["planar", "channels_last"])
@pytest.mark.parametrize("name", list(AUGMENTS))
def test_resized_into_the_rows_is_the_plain_pipeline(name: str, channels_last: bool) -> None:
    augment = AUGMENTS[name]
    for h, w in ((64, 80), (30, 90), (256, 256)):
        images = _images(10, h, w, channels_last, seed=h + w)
        for seed, epoch in ((0, 0), (3, 1), (3, 7)):
            want = _plain(augment, images, sample_generators(seed, epoch, range(20, 30)))
            got = augment(images, sample_generators(seed, epoch, range(20, 30)))
            assert torch.equal(got, want)
            assert got.is_contiguous(
                memory_format=torch.channels_last if channels_last else torch.contiguous_format
            )
            listed = augment(list(images), sample_generators(seed, epoch, range(20, 30)))
            assert torch.equal(listed, want)
            # Into rows 5..15 of a bigger shared batch, as a crop process writes them.
            for fmt in (torch.channels_last, torch.contiguous_format):
                batch = torch.zeros((20, 3, 40, 40), dtype=torch.uint8)
                batch = batch.contiguous(memory_format=fmt)
                gens = sample_generators(seed, epoch, range(20, 30))
                assert augment_into(augment, images, gens, batch[5:15])
                assert torch.equal(batch[5:15], want)
                assert not batch[:5].any() and not batch[15:].any()


def test_augment_into_refuses_what_it_cannot_write_and_draws_nothing() -> None:
    images = _images(4, 64, 64, True)
    crop = RandomResizedCrop(32)
    colour = Compose([crop, RandomHorizontalFlip(), ColorJitter(0.4)])
    flip_first = Compose([RandomHorizontalFlip(), crop])
    out = torch.zeros((4, 3, 32, 32), dtype=torch.uint8)
    for augment, target in (
        (colour, out),
        (flip_first, out),
        (RandomHorizontalFlip(), out),
        (crop, torch.zeros((4, 3, 31, 32), dtype=torch.uint8)),
        (crop, torch.zeros((4, 3, 32, 32), dtype=torch.float32)),
        (crop, torch.zeros((3, 3, 32, 32), dtype=torch.uint8)),
    ):
        gens = sample_generators(0, 0, range(4))
        before = _states(gens)
        assert not augment_into(augment, images, gens, target)
        assert not target.any()
        assert all(torch.equal(a, b) for a, b in zip(before, _states(gens), strict=True))
