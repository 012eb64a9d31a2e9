"""Servers that lie about sizes or answer one object slowly, on a real local HTTP server
(a threaded ``http.server`` in the test), read through :class:`FileSource` and the
DataLoader with ``on_error="skip"``.

- H5: the HEAD of one object says 643 bytes; its GET answers 200 (ignoring ``Range``)
  and streams 256 MiB. It must be refused after the first byte too many, not read
  whole: the bytes the server got out and the peak of Python's heap are measured.
- H6: one object whose server trickles its bytes (or never answers for it) until every
  call's deadline is that object's failure; the healthy objects after it are served.
"""

from __future__ import annotations

import json
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from mmcache.loader import DataLoader
from mmcache.sources.blobs.retry import RetryPolicy
from mmcache.sources.files import FileSource
from mmcache.synth import make_dataset
from mmcache.transforms.pipeline import Pipeline

#: What the lying object streams after its HEAD said 643 bytes.
HUGE = 256 << 20
DECLARED = 643
_CHUNK = 64 << 10


@dataclass
class Objects:
    """What the server serves: honest objects by name, and how the odd ones behave."""

    files: dict[str, bytes]
    liar: str = ""  # HEAD says DECLARED bytes; GET answers 200 and streams HUGE bytes
    slow: str = ""  # answered 206, then one byte per 0.1 s
    silent: str = ""  # the request is read and never answered
    sent: dict[str, int] = field(default_factory=dict)  # body bytes written, by name
    done: threading.Event = field(default_factory=threading.Event)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def _head(self, status: int, length: int, extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(length))
        self.send_header("ETag", f'"{self.path.strip("/")}-v1"')
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()

    def _stream(self, name: str, total: int, chunk: int, pause: float) -> None:
        objects = self.server.objects
        block = b"\0" * chunk
        try:
            while objects.sent.get(name, 0) < total and not objects.done.is_set():
                self.wfile.write(block)
                self.wfile.flush()
                objects.sent[name] = objects.sent.get(name, 0) + chunk
                if pause:
                    time.sleep(pause)
        except OSError:  # the client went away: what a bounded read does
            self.close_connection = True

    def do_HEAD(self) -> None:
        objects, name = self.server.objects, self.path.strip("/")
        if name in objects.files and name == objects.liar:
            self._head(200, DECLARED)
        elif name in objects.files:
            self._head(200, len(objects.files[name]))
        else:
            self._head(404, 0)

    def do_GET(self) -> None:
        objects, name = self.server.objects, self.path.strip("/")
        if name not in objects.files:  # a folder listing: none (fsspec then asks each)
            self._head(404, 0)
        elif name == objects.liar:
            self._head(200, HUGE)  # Range ignored, and far more than the HEAD said
            self._stream(name, HUGE, _CHUNK, 0.0)
        elif name == objects.silent:
            objects.done.wait(60)
            self.close_connection = True
        elif name == objects.slow:
            size = len(objects.files[name])
            self._head(206, size, {"Content-Range": f"bytes 0-{size - 1}/{size}"})
            self._stream(name, size, 1, 0.1)
        else:
            data = objects.files[name]
            wanted = self.headers.get("Range", "").removeprefix("bytes=")
            first, _, last = wanted.partition("-")
            start = int(first or 0)
            end = min(int(last) + 1 if last else len(data), len(data))
            self._head(206, end - start, {"Content-Range": f"bytes {start}-{end - 1}/{len(data)}"})
            self.wfile.write(data[start:end])


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    objects: Objects


@pytest.fixture
def images(tmp_path: Path) -> dict[str, bytes]:
    manifest = make_dataset(tmp_path / "data", 4, seed=3)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    return {
        f"{i:04d}.jpg": (manifest.parent / r["image_path"]).read_bytes() for i, r in enumerate(rows)
    }


@pytest.fixture
def server(images: dict[str, bytes]) -> Iterator[tuple[str, Objects]]:
    objects = Objects(dict(images))
    httpd = _Server(("127.0.0.1", 0), _Handler)
    httpd.objects = objects
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", objects
    finally:
        objects.done.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def source(
    url: str, names: list[str], pipe: Pipeline, tmp_path: Path, policy: RetryPolicy
) -> FileSource:
    manifest = tmp_path / "remote.jsonl"
    rows = [{"id": n.split(".")[0], "image_path": f"{url}/{n}", "caption": "a cat"} for n in names]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return FileSource(
        manifest,
        pipeline=pipe,
        on_error="skip",
        retries=policy,
        offline=False,
        state_dir=tmp_path / "state",
    )


def served_ids(src: FileSource) -> list[str]:
    loader = DataLoader(src, cache=None, batch_size=1, shuffle=False, num_workers=0)
    return [sid for batch in loader for sid in batch["id"]]


def test_an_object_that_streams_more_than_its_head_said_is_refused_at_the_first_extra_byte(
    server, small_pipeline, tmp_path
):
    url, objects = server
    objects.liar = "0001.jpg"
    names = ["0000.jpg", "0001.jpg", "0002.jpg"]
    src = source(url, names, small_pipeline, tmp_path, RetryPolicy(attempts=2, backoff=0.01))
    tracemalloc.start()
    try:
        served = served_ids(src)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert served == ["0000", "0002"]
    (reject,) = src.rejects()
    assert reject.sample_id == "0001"
    # G24: the server answered; the prefix says how, not "no response"
    assert "(HTTP 200, range-ignored)" in reject.reason, reject.reason
    assert "ignored the Range request" in reject.reason and str(DECLARED) in reject.reason
    # Bounded while streaming: the server got out what the socket buffers hold, not the
    # 256 MiB body (read whole before: 256 MiB sent, a heap peak of twice that).
    print(f"\nsent {objects.sent['0001.jpg']} bytes, heap peak {peak} bytes")
    assert objects.sent["0001.jpg"] < HUGE // 8, objects.sent
    assert peak < 32 << 20, peak


@pytest.mark.parametrize("weather", ["slow", "silent"])
def test_one_slow_object_is_refused_alone_and_the_healthy_ones_after_it_are_served(
    weather, server, small_pipeline, tmp_path
):
    url, objects = server
    setattr(objects, weather, "0001.jpg")
    names = ["0000.jpg", "0001.jpg", "0002.jpg", "0003.jpg"]
    policy = RetryPolicy(attempts=2, backoff=0.01, call_deadline=1.0, connect_timeout=1.0)
    src = source(url, names, small_pipeline, tmp_path, policy)
    t0 = time.perf_counter()
    served = served_ids(src)
    elapsed = time.perf_counter() - t0
    assert served == ["0000", "0002", "0003"], [r.reason for r in src.rejects()]
    (reject,) = src.rejects()
    assert reject.sample_id == "0001" and "timeout" in reject.reason, reject.reason
    assert "circuit-open" not in reject.reason
    assert not src.remote.unreachable
    assert elapsed < 30, elapsed  # one deadline of the slow object, not one per object
