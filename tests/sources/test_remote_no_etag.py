"""A server without ETag (Python's ``http.server``): a same-size overwrite is seen (G6).

Objects without an ETag or version id are stamped by the digest of their bytes, fetched at
open and at each revalidation, with one warning naming an object; the URL is in the key.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mmcache.pipeline import Pipeline
from mmcache.sources.remote.files import RemoteFileSource
from mmcache.synth import make_dataset


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


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
    with caplog.at_level(logging.WARNING):
        src = RemoteFileSource(remote, pipeline=small_pipeline, retries=0, state_dir=tmp_path)
    assert caplog.text.count("has no ETag or version id") == 1
    before = [src.key(i) for i in range(3)]
    image = www / rows[1]["image_path"].removeprefix(f"{base}/")
    data = bytearray(image.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    image.write_bytes(bytes(data))
    assert src.revalidate() == [rows[1]["image_path"]]
    after = [src.key(i) for i in range(3)]
    assert after[1] != before[1] and after[0] == before[0] and after[2] == before[2]
