"""Seeded random augmentation after the cache: the transforms, and the loader's ``augment``.

The promise: randomness only from (seed, epoch, sample index), so the augmented
batches are bitwise the same with the cache off, cold, warm, partly warm, with
0 or 2 workers and after a resume mid-epoch; epochs differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mmcache.augment import (
    Compose,
    RandomHorizontalFlip,
    RandomResizedCrop,
    batch_generator,
    sample_generators,
)
from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.errors import ConfigError
from mmcache.features import FeatureCache
from mmcache.loader import Augment, DataLoader
from mmcache.synth import make_dataset
from mmcache.transforms.pipeline import Pipeline

AUG = Compose([RandomResizedCrop(48, scale=(0.3, 1.0)), RandomHorizontalFlip()])


def _epoch(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return list(loader)


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        assert x["id"] == y["id"]
        assert x["image"].shape == y["image"].shape and x["image"].dtype == torch.uint8
        assert torch.equal(x["image"], y["image"])
        assert torch.equal(x["input_ids"], y["input_ids"])


@pytest.fixture
def ds(tmp_path: Path, small_pipeline: Pipeline) -> MultimodalDataset:
    return MultimodalDataset(make_dataset(tmp_path / "data", 40, seed=4), pipeline=small_pipeline)


@pytest.fixture
def reference(ds: MultimodalDataset) -> dict[int, list[dict[str, Any]]]:
    loader = DataLoader(ds, cache=None, batch_size=8, seed=5, augment=AUG)
    return {e: _epoch(loader, e) for e in range(3)}


# ------------------------------------------------------------------------ the transforms
def test_identity_when_scale_and_ratio_are_one_on_a_canvas_of_the_output_size() -> None:
    images = torch.randint(0, 256, (5, 3, 40, 40), dtype=torch.uint8)
    crop = RandomResizedCrop(40, scale=(1.0, 1.0), ratio=(1.0, 1.0))
    assert torch.equal(crop(images, sample_generators(1, 2, range(5))), images)
    listed = crop(list(images), sample_generators(1, 2, range(5)))
    assert torch.equal(listed, images)  # a list in, one fixed-size tensor out


def test_flip_with_p_one_equals_torch_flip_and_p_zero_is_identity() -> None:
    images = torch.randint(0, 256, (4, 3, 9, 13), dtype=torch.uint8)
    gens = sample_generators(0, 0, range(4))
    assert torch.equal(RandomHorizontalFlip(p=1.0)(images, gens), torch.flip(images, [-1]))
    assert torch.equal(
        RandomHorizontalFlip(p=0.0)(images, sample_generators(0, 0, range(4))), images
    )
    listed = RandomHorizontalFlip(p=1.0)(list(images), sample_generators(0, 0, range(4)))
    assert all(torch.equal(a, torch.flip(b, [-1])) for a, b in zip(listed, images, strict=True))


def test_flip_never_changes_its_input_and_compose_equals_the_steps_in_turn() -> None:
    images = torch.randint(0, 256, (6, 3, 20, 24), dtype=torch.uint8)
    kept = images.clone()
    flipped = RandomHorizontalFlip(p=1.0)(images, sample_generators(0, 0, range(6)))
    assert torch.equal(images, kept) and flipped.data_ptr() != images.data_ptr()
    crop, flip = RandomResizedCrop(12, scale=(0.5, 1.0)), RandomHorizontalFlip()
    # Compose flips the crop's fresh output in place: the same as the steps one by one
    gens = sample_generators(3, 1, range(6))
    steps = flip(crop(images, gens), gens)
    composed = Compose([crop, flip])(images, sample_generators(3, 1, range(6)))
    assert torch.equal(composed, steps) and torch.equal(images, kept)
    # a flip before the crop sees the caller's tensor: never changed in place
    Compose([flip, crop])(images, sample_generators(3, 1, range(6)))
    assert torch.equal(images, kept)


def test_crop_boxes_lie_inside_small_and_odd_images_and_outputs_have_the_size() -> None:
    """A crop larger than a small cached image is clipped (torchvision's fallback), never
    an error: every box lies inside its image, and the output is size x size."""
    crop = RandomResizedCrop(64, scale=(0.9, 1.0), ratio=(3 / 4, 4 / 3))
    shapes = [(20, 30), (7, 100), (100, 7), (1, 1), (64, 64)]
    for seed in range(30):
        for h, w in shapes:
            g = sample_generators(seed, 0, [0])[0]
            top, left, ch, cw = crop.params(h, w, g)
            assert top >= 0 and left >= 0 and 0 < ch <= h and 0 < cw <= w
            assert top + ch <= h and left + cw <= w
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for h, w in shapes]
    out = crop(images, sample_generators(0, 0, range(len(shapes))))
    assert out.shape == (len(shapes), 3, 64, 64) and out.dtype == torch.uint8


def test_randomness_is_per_sample_and_never_the_global_rng() -> None:
    images = torch.randint(0, 256, (6, 3, 50, 70), dtype=torch.uint8)
    torch.manual_seed(0)
    a = AUG(images, sample_generators(3, 1, [10, 11, 12, 13, 14, 15]))
    state = torch.get_rng_state()
    torch.manual_seed(123)  # another global state changes nothing
    b = AUG(images, sample_generators(3, 1, [10, 11, 12, 13, 14, 15]))
    assert torch.equal(a, b)
    torch.manual_seed(0)
    AUG(images, sample_generators(3, 1, range(6)))
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG was not drawn from
    # A row's result depends on its own index only, not on its neighbours.
    c = AUG(images[2:4], sample_generators(3, 1, [12, 13]))
    assert torch.equal(c, a[2:4])
    assert not torch.equal(AUG(images, sample_generators(3, 2, range(10, 16))), a)


def test_bad_transform_arguments_are_config_errors() -> None:
    for kwargs in ({"size": 0}, {"size": 8, "scale": (0.5, 2.0)}, {"size": 8, "ratio": (2, 1)}):
        with pytest.raises(ConfigError):
            RandomResizedCrop(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="probability"):
        RandomHorizontalFlip(p=1.5)
    with pytest.raises(ConfigError, match="uint8"):
        RandomHorizontalFlip()(torch.zeros(2, 3, 4, 4), sample_generators(0, 0, [0, 1]))
    with pytest.raises(ConfigError, match="generators"):
        RandomHorizontalFlip()(torch.zeros(2, 3, 4, 4, dtype=torch.uint8), [])


# ------------------------------------------------------------------------ the loader
def test_augmented_batches_are_bitwise_the_same_cache_off_cold_warm_partly_warm_any_workers(
    ds: MultimodalDataset, reference: dict[int, list[dict[str, Any]]], cache_root: Path
) -> None:
    for x in reference[0]:
        assert x["image"].shape[-2:] == (48, 48)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        cold = DataLoader(ds, cache=cache, batch_size=8, seed=5, num_workers=2, augment=AUG)
        _same(_epoch(cold, 0), reference[0])  # cold, misses produced by 2 workers
        assert cold.stats().epochs[-1].misses == 40
        cold.close()
        assert cache.memory is not None
        for i in range(0, 40, 3):  # partly warm
            cache.memory.delete(ds.key(i))
        warm0 = DataLoader(ds, cache=cache, batch_size=8, seed=5, num_workers=0, augment=AUG)
        _same(_epoch(warm0, 1), reference[1])
        e1 = warm0.stats().epochs[-1]
        assert 0 < e1.tier_hits.get("memory", 0) < 40  # the rest from disk or produced
        warm2 = DataLoader(
            ds,
            cache=cache,
            batch_size=8,
            seed=5,
            num_workers=2,
            persistent_workers=True,
            augment=AUG,
        )
        for e in range(3):  # warm: planned, then guessed from learnt keys
            _same(_epoch(warm2, e), reference[e])
        assert warm2.stats().epochs[-1].hits == 40
        warm2.close()


def test_different_epochs_give_different_crops(
    reference: dict[int, list[dict[str, Any]]],
) -> None:
    # Different orders too, so compare each sample's crop by id across epochs.
    crops = [
        {i: b["image"][r] for b in reference[e] for r, i in enumerate(b["id"])} for e in (0, 1)
    ]
    differ = sum(not torch.equal(crops[0][i], crops[1][i]) for i in crops[0])
    assert differ >= 36  # of 40 (a flip-only difference of a symmetric crop is possible)


def test_resume_mid_epoch_gives_the_same_augmented_batches(
    ds: MultimodalDataset, reference: dict[int, list[dict[str, Any]]], cache_root: Path
) -> None:
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=8, seed=5, num_workers=2, augment=AUG)
        loader.set_epoch(1)
        it = iter(loader)
        first = [next(it), next(it)]
        state = loader.state_dict()
        del it
        loader.close()
        again = DataLoader(ds, cache=cache, batch_size=8, seed=5, augment=AUG)
        again.load_state_dict(state)
        again.set_epoch(1)
        _same(first + list(again), reference[1])


def test_a_user_callable_gets_the_images_and_a_generator_seeded_per_batch(
    ds: MultimodalDataset, cache_root: Path
) -> None:
    seen: list[tuple[int, int]] = []

    def noise(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        assert isinstance(generator, torch.Generator) and images.dtype == torch.uint8
        shift = int(torch.randint(0, 50, (1,), generator=generator))
        seen.append((len(images), shift))
        return images.roll(shift, dims=-1)

    ref = _epoch(DataLoader(ds, cache=None, batch_size=8, seed=5, augment=noise), 2)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=8, seed=5, num_workers=2, augment=noise)
        _epoch(loader, 0)
        got = _epoch(loader, 2)  # warm
        loader.close()
    _same(got, ref)
    want = int(torch.randint(0, 50, (1,), generator=batch_generator(5, 2, 3)))
    assert seen[3][1] == want  # batch 3 of epoch 2 of the uncached run


class _Const:
    def __init__(self, out: Any) -> None:
        self.out = out

    def __call__(self, images: torch.Tensor, generator: torch.Generator) -> Any:
        return self.out(images)

    def __repr__(self) -> str:
        return "MyAugment()"


@pytest.mark.parametrize(
    ("out", "match"),
    [
        (lambda im: im.numpy(), "MyAugment.*ndarray, not a tensor"),
        (lambda im: None, "MyAugment.*NoneType"),
        (lambda im: im[:3], "MyAugment.*3 images for a batch of 8"),
        (lambda im: torch.cat([im, im]), "MyAugment.*16 images"),
    ],
)
def test_an_augment_that_changes_the_batch_size_or_returns_no_tensor_is_a_config_error(
    ds: MultimodalDataset, out: Any, match: str
) -> None:
    loader = DataLoader(ds, cache=None, batch_size=8, augment=_Const(out))
    with pytest.raises(ConfigError, match=match):
        next(iter(loader))


def test_bad_augment_or_device_arguments_are_config_errors(ds: MultimodalDataset) -> None:
    with pytest.raises(ConfigError, match="callable"):
        DataLoader(ds, cache=None, batch_size=8, augment="flip")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="device"):
        DataLoader(ds, cache=None, batch_size=8, augment=Augment(AUG, device="nonsense"))


def test_augment_on_cpu_device_and_no_buffer_is_overwritten_while_held(
    ds: MultimodalDataset, reference: dict[int, list[dict[str, Any]]], cache_root: Path
) -> None:
    """The loader recycles batch buffers: an augment returning a view of the gathered
    images (here a no-op slice) must still see later batches leave held ones alone."""
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        view = DataLoader(
            ds, cache=cache, batch_size=8, seed=5, augment=lambda im, g: im[:, :, :, :]
        )
        plain = DataLoader(ds, cache=None, batch_size=8, seed=5)
        _epoch(view, 0)
        held = _epoch(view, 1)  # warm, all held at once
        want = _epoch(plain, 1)
        assert all(torch.equal(a["image"], b["image"]) for a, b in zip(held, want, strict=True))
        cpu = DataLoader(ds, cache=cache, batch_size=8, seed=5, augment=Augment(AUG, device="cpu"))
        _same(_epoch(cpu, 1), reference[1])


def test_feature_cache_refuses_a_loader_with_augment(
    ds: MultimodalDataset, cache_root: Path
) -> None:
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        feats = FeatureCache(
            nn.Flatten(),
            cache=cache,
            preprocess=lambda x: x.float(),
            memory="1MiB",
            name="flat",
            version="1",
        )
        loader = DataLoader(ds, cache=cache, batch_size=8, augment=AUG)
        with pytest.raises(ConfigError, match=r"augment.*differ every epoch"):
            feats.wrap(loader)
        feats.wrap(DataLoader(ds, cache=cache, batch_size=8))  # without augment: fine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_augment_is_deterministic_and_on_the_device(
    ds: MultimodalDataset, cache_root: Path
) -> None:
    ref = _epoch(
        DataLoader(ds, cache=None, batch_size=8, seed=5, augment=Augment(AUG, device="cuda")), 1
    )
    assert ref[0]["image"].is_cuda and ref[0]["image"].dtype == torch.uint8
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(
            ds,
            cache=cache,
            batch_size=8,
            seed=5,
            num_workers=2,
            augment=Augment(AUG, device="cuda"),
        )
        _epoch(loader, 0)
        got = _epoch(loader, 1)
        loader.close()
    _same(
        [{**b, "image": b["image"].cpu()} for b in got],
        [{**b, "image": b["image"].cpu()} for b in ref],
    )
    cpu = _epoch(DataLoader(ds, cache=None, batch_size=8, seed=5, augment=AUG), 1)
    for a, b in zip(ref, cpu, strict=True):  # the same crops; resampling differs by rounding
        diff = (a["image"].cpu().int() - b["image"].int()).abs().float().mean()
        assert diff < 2.0
