import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import mmcache
from mmcache.dataset import MultimodalDataset, collate
from mmcache.errors import ConfigError, SampleError
from mmcache.transforms import ImageSpec, TextSpec
from mmcache.transforms.pipeline import Pipeline


@pytest.fixture
def own_data(tmp_path: Path, tiny_data: Path) -> Path:
    """A copy of the session's tiny dataset that a test may rewrite (``cp -a``)."""
    shutil.copytree(tiny_data.parent, tmp_path / "own", copy_function=shutil.copy2)
    return tmp_path / "own" / tiny_data.name


def _manifest_with_bad(tmp_path: Path, tiny_data: Path) -> Path:
    """The tiny dataset plus one record whose image is missing and one that is not an image."""
    lines = tiny_data.read_text().splitlines()[:6]
    recs = [json.loads(line) for line in lines]
    for r in recs:
        r["image_path"] = str(tiny_data.parent / r["image_path"])
    (tmp_path / "notimage.jpg").write_text("hello")
    recs.insert(2, {"id": "gone", "image_path": "nope.jpg", "caption": "a missing file"})
    recs.insert(4, {"id": "text", "image_path": "notimage.jpg", "caption": "text saved as jpg"})
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return path


def test_item_structure(tiny_data: Path, small_pipeline: Pipeline) -> None:
    ds = MultimodalDataset(tiny_data, pipeline=small_pipeline)
    item = ds[0]
    assert item is not None
    assert isinstance(item["id"], str)
    assert item["image"].dtype == torch.uint8 and tuple(item["image"].shape) == (3, 64, 64)
    assert item["input_ids"].shape == (16,) and item["attention_mask"].shape == (16,)
    assert len(ds) == 48


@pytest.mark.parametrize(("workers", "ctx"), [(0, None), (2, "fork"), (2, "spawn")])
def test_torch_dataloader_default_collate(
    tiny_data: Path, small_pipeline: Pipeline, workers: int, ctx: str | None
) -> None:
    ds = MultimodalDataset(tiny_data, pipeline=small_pipeline)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=8, num_workers=workers, multiprocessing_context=ctx
    )
    ids = []
    for batch in loader:
        assert batch["image"].shape == (len(batch["id"]), 3, 64, 64)
        ids.extend(batch["id"])
    assert ids == [ds.sample_id(i) for i in range(len(ds))]


def test_raise_names_id_path_reason(
    tmp_path: Path, tiny_data: Path, small_pipeline: Pipeline
) -> None:
    ds = MultimodalDataset(_manifest_with_bad(tmp_path, tiny_data), pipeline=small_pipeline)
    with pytest.raises(SampleError) as info:
        ds[2]
    assert info.value.sample_id == "gone"
    assert "nope.jpg" in str(info.value) and "not found" in str(info.value)


def test_skip_drops_counts_and_lists(
    tmp_path: Path, tiny_data: Path, small_pipeline: Pipeline
) -> None:
    ds = MultimodalDataset(
        _manifest_with_bad(tmp_path, tiny_data), pipeline=small_pipeline, on_error="skip"
    )
    loader = torch.utils.data.DataLoader(
        ds, batch_size=4, num_workers=2, collate_fn=collate, multiprocessing_context="fork"
    )
    seen = [i for b in loader for i in b.get("id", [])]
    assert len(seen) == 6 and "gone" not in seen and "text" not in seen
    rejects = {r.sample_id: r for r in ds.rejects()}
    assert set(rejects) == {"gone", "text"}  # found in worker processes, listed in the parent
    assert "not found" in rejects["gone"].reason


def test_keys_change_with_file_caption_and_pipeline(
    tmp_path: Path, own_data: Path, small_pipeline: Pipeline, tokenizer_json: Path
) -> None:
    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    k0 = ds.key(0)
    assert ds.key(0) == k0 and ds.key(1) != k0
    # touching the image file keeps its bytes, so its identity and the key; a rewrite
    # with other bytes changes them (see mmcache.sources.identity)
    path = ds.records.image_path(0)
    assert path is not None
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert ds.key(0) == k0
    Path(path).write_bytes(Path(ds.records.image_path(1) or "").read_bytes())
    assert ds.key(0) != k0
    # another pipeline: another fingerprint
    other = Pipeline(image=ImageSpec(size=32), text=TextSpec(tokenizer_json, max_length=16))
    assert MultimodalDataset(own_data, pipeline=other).key(1) != ds.key(1)
    # another caption
    lines = own_data.read_text().splitlines()
    rec = json.loads(lines[1])
    rec["caption"] += " changed"
    rec["image_path"] = str(own_data.parent / rec["image_path"])
    m = tmp_path / "one.jsonl"
    m.write_text(json.dumps(rec) + "\n")
    assert MultimodalDataset(m, pipeline=small_pipeline).key(0) != ds.key(1)


def test_bad_arguments(tiny_data: Path, small_pipeline: Pipeline) -> None:
    with pytest.raises(ConfigError):
        MultimodalDataset(tiny_data, pipeline=small_pipeline, on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        MultimodalDataset(tiny_data, pipeline="resize")  # type: ignore[arg-type]


def test_public_names() -> None:
    for name in (
        "MultimodalDataset",
        "Pipeline",
        "ImageSpec",
        "TextSpec",
        "read_manifest",
        "Cache",
        "CachedDataset",
        "DataLoader",
        "normalize",
        "train_tokenizer",
    ):
        assert hasattr(mmcache, name), name
    # torch's collate for MultimodalDataset lives in its module (no top-level alias since
    # the deprecation layer went: issue 38)
    assert not hasattr(mmcache, "collate") and callable(collate)


def test_batched_keys_equal_single_keys_and_see_changes(
    own_data: Path, small_pipeline: Pipeline
) -> None:
    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    idx = [5, 0, 17, 5]
    old = ds.keys(idx)
    assert old == [ds.key(i) for i in idx]
    assert ds.keys(idx) == old  # from the memo
    path = ds.records.image_path(17)
    assert path is not None
    Path(path).write_bytes(Path(ds.records.image_path(3) or "").read_bytes())
    again = ds.keys(idx)
    assert again[2] != old[2] and again == [ds.key(i) for i in idx]
    assert again[:2] == old[:2]
    rows = ds.key_rows(idx)
    assert rows.shape == (4, 16) and [r.tobytes() for r in rows] == again
    # a file that disappears gets the "missing" key, and a key of its stamp when restored
    os.rename(path, path + ".away")
    try:
        missing = ds.key_rows([17])[0].tobytes()
        assert missing == ds.key(17) != again[2]
    finally:
        os.rename(path + ".away", path)
    # (a rename sets the file's ctime: a content check finds the same bytes, the same key)
    assert ds.key_rows([17])[0].tobytes() == ds.key(17) == again[2] != missing
    assert ds.key_rows([]).shape == (0, 16)
    with pytest.raises(IndexError):
        ds.key_rows([len(ds)])
