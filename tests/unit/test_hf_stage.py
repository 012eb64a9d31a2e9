"""mmcache.hf_image_processor: the processor's resize/crop cached as uint8; normalize after."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import mmcache as mc
from mmcache.errors import ConfigError
from mmcache.testing.stage_contract import StageContract
from mmcache.transforms import Stage
from mmcache.transforms.hf import HFImageStage
from mmcache.transforms.pixels import upright_rgb

transformers = pytest.importorskip("transformers")

SIZES = [(640, 480), (300, 500), (97, 97), (1200, 300)]
MODES = ["RGB", "L", "RGBA", "P"]


def clip() -> Any:
    return transformers.CLIPImageProcessor(
        size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}
    )


def siglip() -> Any:
    return transformers.SiglipImageProcessor(size={"height": 384, "width": 384})


def _photo(width: int, height: int, mode: str, seed: int) -> Image.Image:
    """Smooth colour with noise (so resampling matters), in ``mode``."""
    rng = np.random.default_rng(seed)
    xs = np.linspace(0, 1, width)[None, :, None]
    ys = np.linspace(0, 1, height)[:, None, None]
    base = 255 * np.concatenate([xs + 0 * ys, ys + 0 * xs, (1 - xs) * ys], axis=2)
    rgb = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    im = Image.fromarray(rgb)
    if mode == "RGBA":
        alpha = rng.integers(0, 256, (height, width), dtype=np.uint8)
        return Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    return im.convert(mode)


@pytest.mark.parametrize(("make", "side"), [(clip, 224), (siglip, 384)])
def test_cached_uint8_then_normalize_equals_the_processors_pixel_values(
    tmp_path: Path, make: Any, side: int
) -> None:
    processor = make()
    stage = mc.hf_image_processor(processor)
    records = []
    for i, (w, h) in enumerate(SIZES):
        for mode in MODES:
            path = tmp_path / f"{i}-{mode}.png"
            _photo(w, h, mode, seed=i).save(path)
            records.append({"id": path.stem, "image_path": str(path), "caption": "x"})
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = mc.MultimodalDataset(manifest, pipeline=mc.Pipeline(image=stage))
    for i, record in enumerate(records):
        cached = ds.produce(i)["image"]
        assert cached.dtype == np.uint8 and cached.shape == (3, side, side)  # never float32
        pixel_values = mc.normalize(torch.from_numpy(cached), stage.mean, stage.std)
        with Image.open(record["image_path"]) as im:
            # the __getitem__ pattern: the processor on the RGB image
            want = processor(upright_rgb(im), return_tensors="np")["pixel_values"][0]
        assert pixel_values.shape == want.shape
        err = np.abs(pixel_values.numpy() - want).max()
        assert err <= 1e-5, (record["id"], err)


def test_mean_and_std_fold_in_rescale_and_normalize() -> None:
    stage = mc.hf_image_processor(clip())
    assert stage.mean == pytest.approx(mc.transforms.CLIP_MEAN) and stage.std == pytest.approx(
        mc.transforms.CLIP_STD
    )
    odd = transformers.CLIPImageProcessor(do_normalize=False, rescale_factor=1 / 127.5)
    s = mc.hf_image_processor(odd)
    im = _photo(300, 200, "RGB", 0)
    want = odd(im, return_tensors="np")["pixel_values"][0]
    got = mc.normalize(torch.from_numpy(s(im)), s.mean, s.std).numpy()
    assert np.abs(got - want).max() <= 1e-5


def test_fingerprint_is_the_config_and_transformers_major(tmp_path: Path) -> None:
    base = mc.hf_image_processor(clip()).fingerprint()
    assert mc.hf_image_processor(clip()).fingerprint() == base
    clip().save_pretrained(tmp_path)
    assert mc.hf_image_processor(tmp_path).fingerprint() == base  # a local folder, offline
    assert mc.hf_image_processor(tmp_path / "preprocessor_config.json").fingerprint() == base
    other = transformers.CLIPImageProcessor(
        size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}
    )
    assert mc.hf_image_processor(other).fingerprint() != base
    # transformers' major version is part of it
    real = sys.modules["mmcache.transforms.hf"]._transformers_major  # type: ignore[attr-defined]
    try:
        sys.modules["mmcache.transforms.hf"]._transformers_major = lambda: 99  # type: ignore[attr-defined]
        assert mc.hf_image_processor(clip()).fingerprint() != base
    finally:
        sys.modules["mmcache.transforms.hf"]._transformers_major = real  # type: ignore[attr-defined]


def test_refusals_name_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="image processor"):
        mc.hf_image_processor(lambda im: im)
    with pytest.raises(ConfigError, match="no image processor at"):
        mc.hf_image_processor(tmp_path / "missing")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'mmcache\[hf\]'"):
        mc.hf_image_processor(tmp_path)


class TestHFStageContract(StageContract):
    __test__ = True

    def make_stage(self) -> Stage:
        return mc.hf_image_processor(transformers.CLIPImageProcessor(crop_size=64, size=64))

    def variants(self) -> Sequence[Stage]:
        return [
            mc.hf_image_processor(transformers.CLIPImageProcessor(crop_size=64, size=72)),
            mc.hf_image_processor(
                transformers.SiglipImageProcessor(size={"height": 64, "width": 64})
            ),
        ]

    def make_input(self) -> Any:
        return _photo(120, 90, "RGB", 3)

    def check_output(self, stage: Stage, output: Any) -> None:
        super().check_output(stage, output)
        assert isinstance(stage, HFImageStage)
        assert output.shape == (3, 64, 64)
