"""What every bytes source shares (``sources.bytesproc``): the ``ImageSpec.max_bytes``
check a loose file gets, errors naming the shard, member and key, and items presented
as the loose-file source presents them (channels-last images as ``[C, H, W]`` views)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

from mmcache.dataset import MultimodalDataset
from mmcache.errors import SampleError
from mmcache.loader import DataLoader
from mmcache.sources.bytesproc import process_bytes
from mmcache.sources.wds import WebDatasetSource, write_shards
from mmcache.synth import make_dataset, make_image
from mmcache.transforms import ImageSpec, TextSpec
from mmcache.transforms.pipeline import Pipeline


def _jpeg(index: int) -> bytes:
    buf = io.BytesIO()
    make_image(index, 0).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def test_a_member_over_max_bytes_is_refused_naming_shard_member_and_key(
    tmp_path: Path, tokenizer_json: Path
) -> None:
    small, big = _jpeg(0), _jpeg(1)
    limit = max(len(small), 1000)
    big = big + b"\0" * (limit + 1 - len(big)) if len(big) <= limit else big  # JPEG ignores it
    path = tmp_path / "t.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in (("a.jpg", small), ("a.txt", b"a"), ("b.jpg", big), ("b.txt", b"b")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    pipe = Pipeline(
        image=ImageSpec(size=64, max_bytes=limit), text=TextSpec(tokenizer_json, max_length=16)
    )
    src = WebDatasetSource(path, pipeline=pipe, index_dir=False)
    assert src.produce(0)["image"].shape == (3, 64, 64)
    with pytest.raises(
        SampleError, match=rf"over the limit of {limit} bytes \(ImageSpec.max_bytes\)"
    ) as info:
        src.produce(1)
    assert info.value.sample_id == "b" and info.value.path == f"{path}:b.jpg"
    assert f"{path}:b.jpg" in str(info.value) and "'b'" in str(info.value)
    skip = WebDatasetSource(path, pipeline=pipe, index_dir=False, on_error="skip")
    got = [sid for batch in DataLoader(skip, cache=None, batch_size=2) for sid in batch["id"]]
    assert got == ["a"] and [r.sample_id for r in skip.rejects()] == ["b"]


def test_missing_parts_are_named_in_each_source_s_terms(tokenizer_json: Path) -> None:
    pipe = Pipeline(image=ImageSpec(size=64), text=TextSpec(tokenizer_json, max_length=16))
    cases = {"member": "sample has no image member", "row": "the row's image is null"}
    for unit, reason in cases.items():
        with pytest.raises(SampleError, match=reason) as info:
            process_bytes(pipe, None, "x", sample_id="k", path="f row 3", unit=unit)  # type: ignore[arg-type]
        assert info.value.path == "f row 3" and "Pipeline(image=None" in info.value.reason
    with pytest.raises(SampleError, match="the record has no text") as info:
        process_bytes(pipe, _jpeg(0), None, sample_id="k", path="s3://b/k.jpg", unit="record")


def test_channels_last_items_of_shards_are_presented_as_loose_files_present_them(
    tmp_path: Path, tokenizer_json: Path
) -> None:
    manifest = make_dataset(tmp_path / "data", 4, seed=1)
    shards = write_shards(manifest, tmp_path / "shards", per_shard=2)
    pipe = Pipeline(
        image=ImageSpec(size=64, channels_last=True), text=TextSpec(tokenizer_json, max_length=16)
    )
    src = WebDatasetSource(shards, pipeline=pipe, index_dir=False)
    files = MultimodalDataset(manifest, pipeline=pipe)
    assert src.channels_last_fields == files.channels_last_fields == frozenset({"image"})
    for i in range(4):
        mine, theirs = src[i], files[i]
        assert mine is not None
        assert mine["image"].shape == theirs["image"].shape == (3, 64, 64)
        np.testing.assert_array_equal(mine["image"].numpy(), theirs["image"].numpy())
