"""Synthetic data: determinism, COCO-like sizes and entropy, large sources, captions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmcache.errors import ConfigError
from mmcache.synth import make_dataset, synth_caption, synth_captions


def read_manifest(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def coco(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("coco"), 20, seed=11, workers=2)


def test_manifest_format(coco: Path) -> None:
    rows = read_manifest(coco)
    assert coco.name == "manifest.jsonl"
    assert len(rows) == 20
    assert [r["id"] for r in rows] == [f"{i:06d}" for i in range(20)]
    for row in rows:
        assert set(row) == {"id", "image_path", "caption"}
        assert row["image_path"] == f"images/{row['id']}.jpg"
        assert (coco.parent / row["image_path"]).is_file()


def test_coco_like_sizes_and_file_sizes(coco: Path) -> None:
    files = [coco.parent / r["image_path"] for r in read_manifest(coco)]
    sides = []
    for f in files:
        with Image.open(f) as img:
            assert img.format == "JPEG" and img.mode == "RGB"
            sides.append(img.size)
    assert all(480 <= max(s) <= 640 and min(s) >= 360 for s in sides)
    assert len({round(w / h, 1) for w, h in sides}) >= 5  # varied aspect ratios
    assert any(w < h for w, h in sides) and any(w > h for w, h in sides)
    kb = np.array([f.stat().st_size for f in files]) / 1000
    assert 40 <= kb.mean() <= 150  # real JPEG entropy, not flat colour (~10 KB)
    assert kb.min() >= 20 and kb.max() <= 200


def test_same_seed_same_bytes_whatever_the_workers(coco: Path, tmp_path: Path) -> None:
    again = make_dataset(tmp_path / "again", 20, seed=11, workers=1)
    assert again.read_bytes() == coco.read_bytes()
    for row in read_manifest(coco):
        assert (again.parent / row["image_path"]).read_bytes() == (
            coco.parent / row["image_path"]
        ).read_bytes()
    other = make_dataset(tmp_path / "other", 3, seed=12)
    assert (other.parent / "images/000000.jpg").read_bytes() != (
        coco.parent / "images/000000.jpg"
    ).read_bytes()
    assert read_manifest(other)[0]["caption"] != read_manifest(coco)[0]["caption"]


def test_prefix_property(coco: Path, tmp_path: Path) -> None:
    """Sample i depends only on (seed, i): a smaller dataset is a prefix of a bigger one."""
    small = make_dataset(tmp_path / "small", 4, seed=11, workers=1)
    assert read_manifest(small) == read_manifest(coco)[:4]
    assert (small.parent / "images/000003.jpg").read_bytes() == (
        coco.parent / "images/000003.jpg"
    ).read_bytes()


def test_large_sources(tmp_path: Path) -> None:
    manifest = make_dataset(tmp_path, 3, seed=2, large=True)
    for row in read_manifest(manifest):
        with Image.open(manifest.parent / row["image_path"]) as img:
            assert 1000 <= max(img.size) <= 2000 and min(img.size) >= 750


def test_quality_changes_file_size(tmp_path: Path) -> None:
    hi = make_dataset(tmp_path / "hi", 2, seed=0, quality=90)
    lo = make_dataset(tmp_path / "lo", 2, seed=0, quality=50)
    first = "images/000000.jpg"
    assert (lo.parent / first).stat().st_size < (hi.parent / first).stat().st_size * 0.7


def test_captions(coco: Path) -> None:
    captions = synth_captions(500, seed=3)
    counts = [len(c.split()) for c in captions]
    assert min(counts) >= 8 and max(counts) <= 30
    assert len(set(counts)) > 10
    assert len(set(captions)) == 500
    assert synth_captions(500, seed=3) == captions
    assert synth_caption(7, seed=3) == captions[7]
    assert all(c == c.strip() and "  " not in c for c in captions)
    # The captions of make_dataset are those of synth_captions for the same seed.
    assert [r["caption"] for r in read_manifest(coco)] == synth_captions(20, seed=11)


def test_empty_dataset_and_validation(tmp_path: Path) -> None:
    assert read_manifest(make_dataset(tmp_path / "empty", 0)) == []
    for bad in (
        {"n": -1},
        {"n": 2, "quality": 0},
        {"n": 2, "quality": 100},
        {"n": 2, "workers": 0},
    ):
        with pytest.raises(ConfigError):
            make_dataset(tmp_path / "bad", **bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        synth_captions(-1)
