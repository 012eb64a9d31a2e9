"""A clip's declared frame size is checked against ``VideoSpec.max_source_pixels`` before
a frame is decoded on every path to ``load_clip``: a WebDataset shard's ``.mp4`` member
and an S3 object refuse it as the sample's error, naming the member or the URL, and
``on_error="skip"`` serves the rest."""

from __future__ import annotations

import io
import json
import re
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
from video_support import video_chat_pipeline, write_clip

import mmcache
from mmcache import VideoSpec
from mmcache.errors import SampleError
from mmcache.sources.files import FileSource
from mmcache.sources.wds import WebDatasetSource
from support.s3 import S3Endpoint, moto_s3

pytest.importorskip("av")
pytest.importorskip("jinja2")

#: Frames up to 64 x 96 pass, the 72 x 128 clip is refused.
_SPEC = VideoSpec(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28, max_source_pixels=64 * 96)
_WHY = re.escape(
    "video frames of 128x72 (9216 pixels; 4 of 24 kept) are over "
    "VideoSpec.max_source_pixels=6144: decoding one takes about 270.00 KiB"
)


@pytest.fixture
def clips(tmp_path: Path) -> dict[str, Path]:
    return {
        "small": write_clip(tmp_path / "v/small.mp4", frames=24, fps=24, size=(64, 96)),
        "large": write_clip(tmp_path / "v/large.mp4", frames=24, fps=24, size=(72, 128)),
    }


def test_a_shard_member_over_max_source_pixels_is_refused(
    tmp_path: Path, clips: dict[str, Path]
) -> None:
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, path in clips.items():
            for name, body in ((f"{key}.mp4", path.read_bytes()), (f"{key}.txt", b"A clip.")):
                info = tarfile.TarInfo(name)
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    src = WebDatasetSource(shard, pipeline=video_chat_pipeline(video=_SPEC), index_dir=False)
    ids = src.ids(range(2))
    assert src.produce(ids.index("small"))["video_sizes"].tolist() == [[4, 56, 84]]
    with pytest.raises(SampleError, match=_WHY) as info:
        src.produce(ids.index("large"))
    assert info.value.sample_id == "large" and info.value.path == f"{shard}:large.mp4"
    skip = WebDatasetSource(shard, pipeline=video_chat_pipeline(video=_SPEC), index_dir=False,
                            on_error="skip")  # fmt: skip
    got = [sid for b in mmcache.DataLoader(skip, cache=None, batch_size=2) for sid in b["id"]]
    assert got == ["small"] and [r.sample_id for r in skip.rejects()] == ["large"]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Endpoint]:
    pytest.importorskip("moto")
    with moto_s3() as endpoint:
        yield endpoint


def test_an_s3_clip_over_max_source_pixels_is_refused(
    s3: S3Endpoint, tmp_path: Path, clips: dict[str, Path]
) -> None:
    prefix = f"limits/{tmp_path.name}"
    urls = {}
    for key, path in clips.items():
        s3.client.upload_file(str(path), "data", f"{prefix}/{path.name}")
        urls[key] = f"s3://data/{prefix}/{path.name}"
    records = [
        {"id": k, "video": url, "conversations": [
            {"from": "human", "value": "<video>"}, {"from": "gpt", "value": "A clip."}]}
        for k, url in urls.items()
    ]  # fmt: skip
    (tmp_path / "m.json").write_text(json.dumps(records))
    src = FileSource(tmp_path / "m.json", pipeline=video_chat_pipeline(video=_SPEC),
                            storage_options=s3.storage_options(), retries=1)  # fmt: skip
    assert src.produce(0)["video_sizes"].tolist() == [[4, 56, 84]]
    with pytest.raises(SampleError, match=_WHY) as info:
        src.produce(1)
    assert info.value.sample_id == "large" and info.value.path == urls["large"]
