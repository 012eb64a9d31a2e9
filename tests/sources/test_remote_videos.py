"""Videos on S3 (a local moto server) through the raw-bytes tier: ``FileSource``
gives the loose files' samples, fetches each clip once (the raw tier serves it after),
keys follow the ETag, and a missing, oversized or damaged clip is a SampleError naming
the URL."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
from video_support import video_chat_pipeline, write_clip

import mmcache
from mmcache import MultimodalDataset, Pipeline
from mmcache.errors import SampleError
from mmcache.sources.blobs import RawTier
from mmcache.sources.files import FileSource
from support.s3 import S3Endpoint, moto_s3

pytest.importorskip("av")
pytest.importorskip("jinja2")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    with moto_s3() as endpoint:
        yield endpoint


def _pipeline(max_bytes: int | None = None) -> Pipeline:
    return video_chat_pipeline(max_bytes)  # type: ignore[no-any-return]


def _records(names: dict[str, str]) -> list[dict[str, object]]:
    return [
        {"id": k, "video": ref, "conversations": [
            {"from": "human", "value": "<video>\nWhat?"}, {"from": "gpt", "value": f"Clip {k}."}]}
        for k, ref in names.items()
    ]  # fmt: skip


def _count_reads(src: FileSource, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The URLs the source GETs from now on (its remote reads)."""
    read, real = [], src.remote.read

    def counted(url: str, start: int, end: int) -> bytes:
        read.append(url)
        return real(url, start, end)

    monkeypatch.setattr(src.remote, "read", counted)
    return read


def _two_clips(s3: S3Endpoint, tmp_path: Path, folder: str) -> tuple[Path, Path, dict[str, str]]:
    """Clips ``a`` (mp4) and ``b`` (webm) under ``tmp_path/v``, uploaded under ``folder``,
    and ``remote.json``: a record of each by URL. Returns both paths and the URLs."""
    a = write_clip(tmp_path / "v/a.mp4", frames=48, fps=24, size=(64, 96))
    b = write_clip(tmp_path / "v/b.webm", frames=30, fps=15, size=(48, 80), codec="libvpx-vp9")
    prefix = f"{folder}/{tmp_path.name}"
    for p in (a, b):
        s3.client.upload_file(str(p), "data", f"{prefix}/{p.name}")
    urls = {"a": f"s3://data/{prefix}/a.mp4", "b": f"s3://data/{prefix}/b.webm"}
    (tmp_path / "remote.json").write_text(json.dumps(_records(urls)))
    return a, b, urls


def test_s3_videos_equal_local_files_fetched_once(
    s3: S3Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, b, urls = _two_clips(s3, tmp_path, "videos")
    prefix = f"videos/{tmp_path.name}"
    (tmp_path / "local.json").write_text(json.dumps(_records({"a": "v/a.mp4", "b": "v/b.webm"})))
    pipe = _pipeline()
    raw = RawTier(tmp_path / "raw", budget="64MiB")
    src = FileSource(tmp_path / "remote.json", pipeline=pipe, raw=raw,
                            storage_options=s3.storage_options(), retries=1)  # fmt: skip
    loose = MultimodalDataset(tmp_path / "local.json", pipeline=pipe)
    read = _count_reads(src, monkeypatch)
    for i in range(2):
        got, want = src.produce(i), loose.produce(i)
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert sorted(read) == sorted(urls.values())  # each clip once
    for i in range(2):  # served by the raw tier now
        src.produce(i)
    assert len(read) == 2
    key = src.key(0)
    s3.client.upload_file(str(b), "data", f"{prefix}/a.mp4")  # overwritten: a new ETag
    again = FileSource(tmp_path / "remote.json", pipeline=pipe, raw=raw,
                              storage_options=s3.storage_options(), retries=1)  # fmt: skip
    assert again.key(0) != key and again.key(1) == src.key(1)
    assert again.produce(0)["video_sizes"].tolist() == loose.produce(1)["video_sizes"].tolist()
    with mmcache.Cache(tmp_path / "cache", memory=0, disk="64MiB") as cache:
        batches = list(mmcache.DataLoader(again, cache=cache, batch_size=2, shuffle=False))
        assert batches[0]["video_counts"].tolist() == [1, 1]


def test_missing_oversized_and_damaged_clips_are_sample_errors(
    s3: S3Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = write_clip(tmp_path / "v/g.mp4", frames=48, fps=24, size=(64, 96))
    prefix = f"bad/{tmp_path.name}"
    s3.client.upload_file(str(good), "data", f"{prefix}/g.mp4")
    data = good.read_bytes()
    s3.client.put_object(Bucket="data", Key=f"{prefix}/cut.mp4", Body=data[: len(data) // 3])
    big = data + b"\0" * 4096
    s3.client.put_object(Bucket="data", Key=f"{prefix}/big.mp4", Body=big)
    names = {k: f"s3://data/{prefix}/{k}.mp4" for k in ("g", "cut", "big", "gone")}
    (tmp_path / "m.json").write_text(json.dumps(_records(names)))
    src = FileSource(tmp_path / "m.json", pipeline=_pipeline(max_bytes=len(data) + 1),
                            storage_options=s3.storage_options(), retries=1)  # fmt: skip
    assert src.produce(0)["videos"].size > 0
    read = _count_reads(src, monkeypatch)
    for i, (k, why) in enumerate([("cut", "cannot decode"), ("big", "over the limit"),
                                  ("gone", "cannot fetch")], start=1):  # fmt: skip
        with pytest.raises(SampleError, match=why) as info:
            src.produce(i)
        assert info.value.sample_id == k and info.value.path == names[k]
    assert names["big"] not in read  # refused by its listed size, never fetched


def test_clips_overwritten_during_a_run_are_revalidated_and_fetched_ahead(
    s3: S3Endpoint, tmp_path: Path
) -> None:
    # RemoteVideoSource had no revalidation ("Not here yet"): a clip overwritten during a
    # run kept its old key until the source was opened again. FileSource over objects
    # revalidates its clips as it does images, and RemotePrefetch drives it.
    from mmcache.sources.blobs.prefetch import RemotePrefetch
    from mmcache.sources.capabilities import Revalidating, SharesStamps

    _, b, urls = _two_clips(s3, tmp_path, "reval")
    prefix = f"reval/{tmp_path.name}"
    raw = RawTier(tmp_path / "raw", budget="64MiB")
    src = FileSource(tmp_path / "remote.json", pipeline=_pipeline(), raw=raw,
                     storage_options=s3.storage_options(), retries=1)  # fmt: skip
    assert isinstance(src, Revalidating) and isinstance(src, SharesStamps)
    RemotePrefetch(src)  # accepted: it checks the clips again at each epoch
    before = [src.key(0), src.key(1)]
    assert src.revalidate() == []
    s3.client.upload_file(str(b), "data", f"{prefix}/a.mp4")  # overwritten: a new ETag
    assert src.revalidate() == [urls["a"]]
    assert src.key(0) != before[0] and src.key(1) == before[1]
    (tmp_path / "v" / "local.json").write_text(json.dumps(_records({"b": "b.webm"})))
    loose = MultimodalDataset(tmp_path / "v" / "local.json", pipeline=_pipeline())
    got = src.produce(0)["video_sizes"].tolist()
    assert got == loose.produce(0)["video_sizes"].tolist()  # the new clip's frames
