"""mmcache.stage: user callables as cached stages (fingerprint by content or version=)."""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import mmcache as mc
from mmcache.errors import ConfigError, SampleError
from mmcache.testing.stage_contract import StageContract
from mmcache.transforms import Stage, UserStage

SHIFT = 3  # a global the stage below reads: part of its fingerprint


def thumb(im: Image.Image, side: int = 16) -> np.ndarray:
    """A module-level image stage (picklable for spawn workers): HWC uint8."""
    return np.asarray(im.resize((side, side)), dtype=np.uint8) // 2 + SHIFT


def char_codes(text: str, length: int = 8) -> dict[str, np.ndarray]:
    codes = [ord(c) % 256 for c in text[:length]]
    ids = np.zeros(length, dtype=np.int32)
    ids[: len(codes)] = codes
    return {"input_ids": ids, "attention_mask": (ids != 0).astype(np.int32)}


def _gradient(width: int, height: int) -> Image.Image:
    xs = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    ys = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    arr = np.stack([xs + 0 * ys, ys + 0 * xs, (xs + ys) / 2], axis=-1).astype(np.uint8)
    return Image.fromarray(arr)


class TestUserImageStageContract(StageContract):
    __test__ = True

    def make_stage(self) -> Stage:
        return mc.stage(thumb)

    def variants(self) -> Sequence[Stage]:
        return [
            mc.stage(functools.partial(thumb, side=8)),
            mc.stage(thumb, version="1"),
            mc.stage(thumb, version="2"),
        ]

    def make_input(self) -> Any:
        return _gradient(50, 40)

    def check_output(self, stage: Stage, output: Any) -> None:
        super().check_output(stage, output)
        assert output.shape[0] == 3  # HWC was transposed to CHW


class TestUserTextStageContract(StageContract):
    __test__ = True

    def make_stage(self) -> Stage:
        return mc.stage(char_codes, kind="text")

    def variants(self) -> Sequence[Stage]:
        return [mc.stage(functools.partial(char_codes, length=4), kind="text")]

    def make_input(self) -> Any:
        return "a dog"


# --------------------------------------------------------------------------------------------
# fingerprints
# --------------------------------------------------------------------------------------------


def _shader(level: int) -> Callable[[Image.Image], np.ndarray]:
    def shade(im: Image.Image) -> np.ndarray:
        return np.full((3, 4, 4), level, dtype=np.uint8)

    return shade


def test_fingerprint_follows_code_and_captured_constants() -> None:
    assert mc.stage(_shader(1)).fingerprint() == mc.stage(_shader(1)).fingerprint()
    assert mc.stage(_shader(1)).fingerprint() != mc.stage(_shader(2)).fingerprint()
    assert mc.stage(lambda im: 1).fingerprint() != mc.stage(lambda im: 2).fingerprint()
    # version= pins it: the code no longer matters
    assert (
        mc.stage(_shader(1), version="v1").fingerprint()
        == mc.stage(_shader(2), version="v1").fingerprint()
    )
    assert mc.stage(_shader(1), version="v1").fingerprint() != mc.stage(_shader(1)).fingerprint()
    # a global the function reads is part of it
    global SHIFT
    before = mc.stage(thumb).fingerprint()
    SHIFT = 4
    try:
        assert mc.stage(thumb).fingerprint() != before
    finally:
        SHIFT = 3


def test_a_callable_that_cannot_be_fingerprinted_needs_a_version() -> None:
    for opaque in (np.flipud, len, functools.partial(np.asarray, dtype=np.uint8), Image.Image):
        with pytest.raises(ConfigError, match="version="):
            mc.stage(opaque)
        assert mc.stage(opaque, version="1").version == "1"
    captured = object()
    with pytest.raises(ConfigError, match="version"):
        mc.stage(lambda im: captured)
    with pytest.raises(ConfigError, match="callable"):
        mc.stage("resize")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="kind"):
        mc.stage(thumb, kind="audio")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="version"):
        mc.stage(thumb, version="")


def test_pipeline_wraps_plain_callables_by_their_slot(tmp_path: Path) -> None:
    pipe = mc.Pipeline(image=thumb, text=char_codes)
    assert isinstance(pipe.image, UserStage) and pipe.image.kind == "image"
    assert isinstance(pipe.text, UserStage) and pipe.text.kind == "text"
    # a stage built with kind=None takes the slot's kind; an explicit one is checked
    assert mc.Pipeline(text=mc.stage(char_codes)).text.kind == "text"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="of kind 'image'"):
        mc.Pipeline(text=mc.stage(thumb, kind="image"))
    assert (
        mc.Pipeline(image=thumb).fingerprint() == mc.Pipeline(image=mc.stage(thumb)).fingerprint()
    )
    path = tmp_path / "a.png"
    _gradient(60, 30).save(path)
    out = pipe.process(path, "a dog", sample_id="a")
    assert out["image"].shape == (3, 16, 16) and out["image"].dtype == np.uint8
    want = np.asarray(_gradient(60, 30).resize((16, 16))) // 2 + SHIFT
    assert np.array_equal(out["image"], want.transpose(2, 0, 1))
    assert out["input_ids"].tolist()[:5] == [ord(c) for c in "a dog"]


def test_image_stages_get_upright_rgb(tmp_path: Path) -> None:
    seen: list[tuple[str, tuple[int, int]]] = []

    def record(im: Image.Image) -> np.ndarray:
        seen.append((im.mode, im.size))
        return np.zeros((1, 2, 2), np.uint8)

    rgba = Image.new("RGBA", (30, 20), (255, 0, 0, 0))  # fully transparent red
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate: stored 30x20 is upright 20x30
    path = tmp_path / "a.png"
    rgba.save(path, exif=exif)
    pipe = mc.Pipeline(image=record)
    pipe.process(path, None, sample_id="a")
    assert seen == [("RGB", (20, 30))]
    white = mc.Pipeline(image=lambda im: np.asarray(im)).process(path, None, sample_id="a")
    assert white["image"].shape == (3, 30, 20) and (white["image"] == 255).all()


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (np.zeros((4, 4, 3), np.float32), r"float32 \[4, 4, 3\]"),
        (np.zeros((4, 4), np.uint8), r"uint8 \[4, 4\]"),
        (np.zeros((4, 5, 6), np.uint8), r"neither \[C,H,W\] nor \[H,W,C\]"),
        ("pixels", "returned a str"),
    ],
)
def test_bad_image_outputs_are_sample_errors_naming_the_stage(
    tmp_path: Path, returned: Any, message: str
) -> None:
    path = tmp_path / "a.png"
    _gradient(8, 8).save(path)

    def bad(im: Image.Image) -> Any:
        return returned

    with pytest.raises(SampleError, match=message) as info:
        mc.Pipeline(image=bad).process(path, None, sample_id="s1")
    assert "bad" in str(info.value) and info.value.sample_id == "s1"
    assert info.value.path == str(path)


def test_tensor_outputs_are_accepted_and_bad_text_outputs_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    _gradient(8, 8).save(path)
    tensor = mc.Pipeline(image=lambda im: torch.zeros(3, 2, 2, dtype=torch.uint8))
    assert tensor.process(path, None, sample_id="a")["image"].shape == (3, 2, 2)
    for bad, message in (
        (lambda s: [1, 2], "returned list"),
        (lambda s: {"ids": np.zeros(3, np.float32)}, "float32 array"),
        (lambda s: {"image": np.zeros(3, np.int32)}, "'image' is the image stage's"),
    ):
        with pytest.raises(SampleError, match=message) as info:
            mc.Pipeline(text=bad).process(None, "a dog", sample_id="t1")
        assert info.value.sample_id == "t1"


# --------------------------------------------------------------------------------------------
# through the cache: called once per sample, across worker processes
# --------------------------------------------------------------------------------------------


def _counting(calls: str, level: int) -> Callable[[Image.Image], np.ndarray]:
    """An image stage that leaves one file in ``calls`` per call (any process)."""

    def shade(im: Image.Image) -> np.ndarray:
        Path(calls, f"{os.getpid()}-{uuid.uuid4().hex}").touch()
        small = np.asarray(im.resize((12, 8)), dtype=np.uint8)
        return small // 2 + level

    return shade


def _images(loader: mc.DataLoader) -> dict[str, torch.Tensor]:
    return {i: b["image"][k] for b in loader for k, i in enumerate(b["id"])}


def _calls(calls: Path) -> list[str]:
    return sorted(p.name for p in calls.iterdir())


def test_a_user_stage_runs_once_per_sample_then_never_on_warm_epochs(
    tiny_data: Path, tokenizer_json: Path, cache_root: Path, tmp_path: Path
) -> None:
    calls = tmp_path / "calls"
    calls.mkdir()
    text = mc.TextSpec(tokenizer_json, max_length=16)

    def loader(fn: Any, cache: mc.Cache) -> mc.DataLoader:
        ds = mc.MultimodalDataset(tiny_data, pipeline=mc.Pipeline(image=fn, text=text))
        return mc.DataLoader(ds, cache=cache, batch_size=8, num_workers=2, seed=1)

    cache = mc.Cache(cache_root, memory="32MiB", disk=None, temporary=True)
    try:
        first = loader(_counting(str(calls), 0), cache)
        batches = [list(first) for _ in range(2)]
        e0, e1 = first.stats().epochs
        assert (e0.misses, e1.hits, e1.misses) == (48, 48, 0)
        made = _calls(calls)
        assert len(made) == 48, "one call per sample, none on the warm epoch"
        assert {name.split("-")[0] for name in made} - {str(os.getpid())}, "ran in workers"
        assert batches[1][0]["image"].shape == (8, 3, 8, 12)
        del first
        # a changed captured constant: a new fingerprint, so every sample is made again
        changed = loader(_counting(str(calls), 1), cache)
        list(changed)
        assert changed.stats().epochs[0].misses == 48 and len(_calls(calls)) == 96
        del changed
        # version= pins the fingerprint: the code changed but the entries are served
        pinned = loader(mc.stage(_counting(str(calls), 2), version="v1"), cache)
        made_pinned = _images(pinned)
        assert pinned.stats().epochs[0].misses == 48 and len(_calls(calls)) == 144
        del pinned
        repinned = loader(mc.stage(_counting(str(calls), 5), version="v1"), cache)
        served = _images(repinned)
        assert repinned.stats().epochs[0].hits == 48 and len(_calls(calls)) == 144
        assert all(torch.equal(served[i], made_pinned[i]) for i in made_pinned)  # as pinned
        del repinned
    finally:
        cache.close()


def keep_aspect(im: Image.Image) -> np.ndarray:
    """The shorter side to 20, the aspect ratio kept: outputs of varied shapes."""
    w, h = im.size
    s = 20 / min(w, h)
    return np.asarray(im.resize((max(1, round(w * s)), max(1, round(h * s)))))


def test_a_user_stage_of_varied_shapes_gives_lists_with_image_sizes(
    tokenizer_json: Path, cache_root: Path, tmp_path: Path
) -> None:
    varied = mc.stage(keep_aspect, fixed_shape=False)
    assert not varied.fixed_shape and mc.stage(keep_aspect).fixed_shape
    # how batches are built is not what is cached: the keys are the same either way
    assert varied.fingerprint() == mc.stage(keep_aspect).fingerprint()
    with pytest.raises(ConfigError, match="fixed_shape must be a bool"):
        mc.stage(keep_aspect, fixed_shape=0)  # type: ignore[arg-type]
    text = mc.TextSpec(tokenizer_json, max_length=16)
    data = mc.synth.make_dataset(tmp_path / "data", 24, seed=3)
    ds = mc.MultimodalDataset(data, pipeline=mc.Pipeline(image=varied, text=text))
    assert ds.varying_fields == {"image"}
    plain = mc.DataLoader(ds, cache=None, batch_size=6, seed=2)
    refs = []
    for epoch in range(2):
        plain.set_epoch(epoch)
        refs.append(list(plain))
    assert len({tuple(t.shape) for b in refs[0] for t in b["image"]}) > 1
    with mc.Cache(cache_root, memory="16MiB", disk=None, temporary=True) as cache:
        loader = mc.DataLoader(ds, cache=cache, batch_size=6, seed=2, num_workers=2)
        for epoch in range(2):  # cold through the workers, then warm from memory
            loader.set_epoch(epoch)
            got = list(loader)
            for x, y in zip(got, refs[epoch], strict=True):
                assert x["id"] == y["id"] and torch.equal(x["image_sizes"], y["image_sizes"])
                assert all(torch.equal(a, b) for a, b in zip(x["image"], y["image"], strict=True))
        first, second = loader.stats().epochs
        assert (first.misses, second.hits, second.misses) == (24, 24, 0)


@pytest.mark.parametrize(
    "module", ["mmcache.transforms.user", "mmcache.transforms.pixels", "mmcache.transforms.hf"]
)
def test_docstring_examples_run(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
