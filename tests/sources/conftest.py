"""Fixtures of the source tests: a local HTTP server that gives no ETag."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


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
