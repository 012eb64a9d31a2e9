"""Video members of WebDataset shards (``key.mp4`` / ``.webm`` + ``key.txt``): decoded
from the member's bytes, bitwise the loose file's sample; the member's size checked from
its tar header before it is read; a damaged or truncated member a SampleError naming the
shard and the member (counted under on_error="skip")."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
from video_support import video_chat_pipeline, write_clip

import mmcache
from mmcache import MultimodalDataset, Pipeline
from mmcache.errors import SampleError
from mmcache.sources.wds import WebDatasetSource

pytest.importorskip("av")
pytest.importorskip("jinja2")


def _pipeline(max_bytes: int | None = None) -> Pipeline:
    return video_chat_pipeline(max_bytes)  # type: ignore[no-any-return]


def _shard(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def clips(tmp_path: Path) -> dict[str, bytes]:
    a = write_clip(tmp_path / "clips/a.mp4", frames=48, fps=24, size=(64, 96))
    b = write_clip(tmp_path / "clips/b.webm", frames=30, fps=15, size=(48, 80), codec="libvpx-vp9")
    return {"a.mp4": a.read_bytes(), "b.webm": b.read_bytes()}


def test_video_members_give_the_loose_files_samples(
    tmp_path: Path, cache_root: Path, clips: dict[str, bytes]
) -> None:
    captions = {"a": "A square crosses.", "b": "Colours shift."}
    members = [(name, data) for name, data in clips.items()]
    members += [(f"{k}.txt", v.encode()) for k, v in captions.items()]
    shard = _shard(tmp_path / "s.tar", members)
    pipe = _pipeline()
    src = WebDatasetSource(shard, pipeline=pipe, index_dir=False)
    records = [
        {"id": k, "video": f"clips/{name}", "conversations": [
            {"from": "human", "value": "<video>"}, {"from": "gpt", "value": captions[k]}]}
        for name, k in (("a.mp4", "a"), ("b.webm", "b"))
    ]  # fmt: skip
    (tmp_path / "m.json").write_text(json.dumps(records))
    loose = MultimodalDataset(tmp_path / "m.json", pipeline=pipe)
    for i, sid in enumerate(src.ids(range(len(src)))):
        got, want = src.produce(i), loose.produce(loose.records.index_of(sid))
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{sid} {name}")
    assert src.varying_fields >= {"videos", "video_sizes", "input_ids"}
    with mmcache.Cache(cache_root, memory="64MiB", disk=None) as cache:
        loader = mmcache.DataLoader(src, cache=cache, batch_size=2, shuffle=False)
        for _ in range(2):  # cold, then from the cache
            (batch,) = list(loader)
            assert batch["video_counts"].tolist() == [1, 1]
        assert loader.stats().epochs[1].hits == 2


def _bad_members(clips: dict[str, bytes]) -> list[tuple[str, bytes]]:
    good = clips["a.mp4"]
    return [
        ("good.mp4", good), ("good.txt", b"fine"),
        ("cut.mp4", good[: len(good) // 3]), ("cut.txt", b"truncated"),
        ("junk.mov", b"\x00\x01not a video" * 50), ("junk.txt", b"garbage"),
    ]  # fmt: skip


def test_damaged_and_truncated_members_are_sample_errors_naming_shard_and_member(
    tmp_path: Path, clips: dict[str, bytes]
) -> None:
    shard = _shard(tmp_path / "bad.tar", _bad_members(clips))
    src = WebDatasetSource(shard, pipeline=_pipeline(), index_dir=False)
    assert src.produce(src.ids(range(3)).index("good"))["videos"].size > 0
    for key, ext in (("cut", "mp4"), ("junk", "mov")):
        with pytest.raises(SampleError) as info:
            src.produce(src.ids(range(3)).index(key))
        assert info.value.sample_id == key and info.value.path == f"{shard}:{key}.{ext}"
    skip = WebDatasetSource(shard, pipeline=_pipeline(), index_dir=False, on_error="skip")
    got = [sid for b in mmcache.DataLoader(skip, cache=None, batch_size=3) for sid in b["id"]]
    assert got == ["good"]
    assert sorted(r.sample_id for r in skip.rejects()) == ["cut", "junk"]


def test_a_member_over_max_bytes_is_refused_before_it_is_read(
    tmp_path: Path, clips: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    small = clips["b.webm"]
    shard = _shard(tmp_path / "big.tar", [("a.mp4", clips["a.mp4"]), ("a.txt", b"big"),
                                          ("b.webm", small), ("b.txt", b"small")])  # fmt: skip
    limit = len(small)
    assert len(clips["a.mp4"]) > limit
    src = WebDatasetSource(shard, pipeline=_pipeline(max_bytes=limit), index_dir=False)
    read: list[tuple[int, int]] = []
    real = src._pread

    def spy(shard_no: int, start: int, end: int, sid: Any = None) -> bytes:
        read.append((start, end))
        return real(shard_no, start, end, sid)

    monkeypatch.setattr(src, "_pread", spy)
    with pytest.raises(SampleError, match=rf"over the limit of {limit} bytes") as info:
        src.produce(0)
    assert info.value.path == f"{shard}:a.mp4" and read == []  # nothing of it was read
    assert src.produce(1)["videos"].size > 0
