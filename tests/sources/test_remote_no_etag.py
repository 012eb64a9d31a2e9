"""A server without ETag (Python's ``http.server``): a same-size overwrite is seen (G6).

Objects without an ETag or version id (loose image files and WebDataset shards) are stamped
by the digest of their bytes, fetched at open and at each revalidation, with one warning
naming an object. (That digest is the identity of a loose object's bytes: its key does not
hold the URL, ``test_remote_identity.py``.)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from mmcache.sources.files import FileSource
from mmcache.sources.wds import WebDatasetSource
from mmcache.sources.wds.write import write_shards
from mmcache.synth import make_dataset
from mmcache.transforms.pipeline import Pipeline

T = TypeVar("T")


def _opened_with_one_warning(caplog: pytest.LogCaptureFixture, make: Callable[[], T]) -> T:
    """``make()``, checking that it warned once that the server gives no ETag."""
    with caplog.at_level(logging.WARNING):
        made = make()
    assert caplog.text.count("has no ETag or version id") == 1
    return made


def _flip(path: Path, at: int) -> None:
    """Flip the byte at offset ``at`` of ``path``: same size, other bytes."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_same_size_overwrite_on_a_server_without_etag_is_seen(
    served: tuple[Path, str],
    tmp_path: Path,
    small_pipeline: Pipeline,
    caplog: pytest.LogCaptureFixture,
) -> None:
    www, base = served
    manifest = make_dataset(www, 3, seed=5)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    for row in rows:
        row["image_path"] = f"{base}/{row['image_path']}"
    remote = tmp_path / "remote.jsonl"
    remote.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = _opened_with_one_warning(
        caplog,
        lambda: FileSource(remote, pipeline=small_pipeline, retries=0, state_dir=tmp_path),
    )
    before = [src.key(i) for i in range(3)]
    image = www / rows[1]["image_path"].removeprefix(f"{base}/")
    _flip(image, image.stat().st_size // 2)
    assert src.revalidate() == [rows[1]["image_path"]]
    after = [src.key(i) for i in range(3)]
    assert after[1] != before[1] and after[0] == before[0] and after[2] == before[2]


def test_a_same_size_overwrite_of_a_shard_on_a_server_without_etag_is_seen(
    served: tuple[Path, str],
    tmp_path: Path,
    small_pipeline: Pipeline,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """G6 for WebDataset shards: the size alone (main's stamp) kept the old index and keys."""
    www, base = served
    shards = write_shards(make_dataset(tmp_path / "data", 4, seed=6), www, per_shard=2)
    urls = [f"{base}/{p.name}" for p in shards]
    src = _opened_with_one_warning(
        caplog,
        lambda: WebDatasetSource(
            urls, pipeline=small_pipeline, retries=0, index_dir=tmp_path / "ix"
        ),
    )
    assert urls[0] in caplog.text
    before = [src.key(i) for i in range(len(src))]
    start, end = src.span(2)
    _flip(shards[1], start + (end - start) // 2)  # inside sample 2's span
    assert src.revalidate() == [urls[1]]
    after = [src.key(i) for i in range(len(src))]
    assert after[:2] == before[:2]
    assert after[2] != before[2] and after[3] != before[3]


def test_a_same_size_overwrite_of_a_clip_on_a_server_without_etag_is_seen(
    served: tuple[Path, str],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # RemoteVideoSource stamped a clip without ETag by its size alone ("size=N"): a
    # same-size overwrite kept its key and its old frames were served. FileSource over
    # objects stamps clips as it stamps images: by the digest of their bytes.
    pytest.importorskip("av")
    pytest.importorskip("jinja2")
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent / "unit"))
    from video_support import video_chat_pipeline, write_clip

    www, base = served
    clip = write_clip(www / "v" / "a.mp4", frames=12, fps=12, size=(48, 80))
    talk = [{"from": "human", "value": "<video>\nWhat?"}, {"from": "gpt", "value": "A clip."}]
    record = {"id": "a", "video": f"{base}/v/a.mp4", "conversations": talk}
    (tmp_path / "m.json").write_text(json.dumps([record]))
    pipe = video_chat_pipeline()

    def open_source() -> FileSource:
        return FileSource(tmp_path / "m.json", pipeline=pipe, retries=0, state_dir=tmp_path)

    src = _opened_with_one_warning(caplog, open_source)
    before = src.key(0)
    _flip(clip, clip.stat().st_size - 16)  # same size, other bytes
    assert open_source().key(0) != before  # a source opened now has the new bytes' key
    assert src.revalidate() == [record["video"]] and src.key(0) != before
