"""What an image stage declares beyond the Stage protocol (``ImageTraits``), read in one
place by the pipeline and the sources: the same limit for a loose file and for bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from PIL import Image

import mmcache as mc
from mmcache.errors import SampleError
from mmcache.sources.bytesproc import byte_limit

MiB = 1 << 20


class _SmallFilesOnly:
    """A user's own image stage that declares its byte limit (and nothing else)."""

    kind: ClassVar[str] = "image"
    max_bytes = 64

    def fingerprint(self) -> str:
        return "small-files-only-v1"

    def __call__(self, image: Any, /) -> np.ndarray:
        return np.zeros((3, 2, 2), dtype=np.uint8)


def test_a_user_stage_s_own_byte_limit_bounds_a_loose_file(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    Image.new("RGB", (64, 64), (200, 10, 10)).save(path)
    assert path.stat().st_size > _SmallFilesOnly.max_bytes
    pipe = mc.Pipeline(image=_SmallFilesOnly())
    with pytest.raises(SampleError, match="over the limit of 64 bytes"):
        pipe.process(str(path), None, sample_id="a")
    assert byte_limit(pipe) == 64  # a shard member or a row cell: the same limit


def test_a_stage_that_declares_no_limit_gets_the_default_for_bytes_as_for_files() -> None:
    smart = mc.Pipeline(image=mc.SmartResize(56 * 56, 28 * 28 * 16))
    assert byte_limit(smart) == 256 * MiB
    assert byte_limit(mc.Pipeline(image=mc.ImageSpec(64, max_bytes=None))) is None
    assert byte_limit(mc.Pipeline(image=mc.ImageSpec(64, max_bytes=1000))) == 1000


def test_traits_of_the_built_in_stages_and_of_a_stage_declaring_none() -> None:
    from mmcache.transforms.stage import DEFAULT_MAX_BYTES, ImageTraits

    spec = mc.ImageSpec(64, crop=None, channels_last=True, exif_transpose=False, max_bytes=9)
    assert ImageTraits.of(spec) == ImageTraits(
        fixed_shape=False, channels_last=True, exif_transpose=False, max_bytes=9
    )
    assert ImageTraits.of(mc.SmartResize()).fixed_shape is False
    assert ImageTraits.of(_SmallFilesOnly()) == ImageTraits(max_bytes=64)
    assert ImageTraits.of(object()) == ImageTraits()
    assert ImageTraits().max_bytes == DEFAULT_MAX_BYTES == 256 * MiB
