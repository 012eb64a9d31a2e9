"""A server without ETag (Python's ``http.server``): a same-size overwrite is seen (G6).

Objects without an ETag or version id (loose image files and WebDataset shards) are stamped
by the digest of their bytes, fetched at open and at each revalidation, with one warning
naming an object; the URL is in the key.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

import pytest

from mmcache.pipeline import Pipeline
from mmcache.sources.remote.files import RemoteFileSource
from mmcache.sources.wds import WebDatasetSource
from mmcache.sources.wds.write import write_shards
from mmcache.synth import make_dataset

T = TypeVar("T")


class _Quiet(SimpleHTTPRequestHandler):
    """Files with Last-Modified and Content-Length, no ETag; a ``Range: bytes=a-b`` GET is
    answered 206 with those bytes (shards are read in ranges)."""

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        wanted = self.headers.get("Range", "")
        if not wanted.startswith("bytes="):
            super().do_GET()
            return
        data = Path(self.translate_path(self.path)).read_bytes()
        first, _, last = wanted.removeprefix("bytes=").partition("-")
        start, end = int(first), min(int(last) + 1 if last else len(data), len(data))
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        self.wfile.write(data[start:end])


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """``tmp_path / "www"`` served over HTTP (Last-Modified, no ETag)."""
    www = tmp_path / "www"
    www.mkdir()
    handler = functools.partial(_Quiet, directory=str(www))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield www, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


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
        lambda: RemoteFileSource(remote, pipeline=small_pipeline, retries=0, state_dir=tmp_path),
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
