"""Bad weather for tests and benchmarks: an HTTP proxy in front of a local store (moto's
S3 server, the GCS emulator) that adds latency, answers 5xx for a fraction of requests,
drops connections, stalls mid-response or goes silent; and a plain HTTP file server
with (or without) ``Range`` support.

:class:`FaultProxy` forwards each request it receives on ``127.0.0.1:<port>`` to the
target with :mod:`http.client` (one upstream connection per client connection, kept
alive) and answers with the upstream's status, headers and body, unless its current
:attr:`~FaultProxy.mode` or :attr:`~FaultProxy.error_rate` says otherwise:

- ``"up"``: forwarded (after :attr:`~FaultProxy.latency` seconds);
- ``"refuse"``: the listening socket is closed (a new connection is refused) and every
  open connection is closed at its next request: a store that went down;
- ``"drop"``: each request is read and its connection closed with no answer;
- ``"silent"``: each request is read and never answered (until the mode changes or the
  proxy closes): a black-holed network;
- ``"stall"``: the upstream's headers and half of its body are sent, then nothing.

With ``error_rate=p``, each request (in ``"up"``) is answered ``503 SlowDown`` with
probability ``p`` (a seeded :class:`random.Random`: the same requests fail on each run
of the same sequence). :attr:`~FaultProxy.requests` records what came in
(:class:`support.s3.Request`), :attr:`~FaultProxy.injected` how many answers
it made up.

:func:`http_files` serves a folder over HTTP on 127.0.0.1 (:mod:`http.server`), with an
``ETag`` per file and ``Range`` requests answered ``206`` (``honour_range=False``: the
whole file, ``200``, as Python's own ``http.server`` does).

Thread-safe: both run one thread per connection; the proxy's settings may be changed
from any thread at any time (they apply from the next request).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import re
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from support.s3 import Request

__all__ = ["FaultProxy", "HttpFiles", "Mode", "http_files"]

Mode = Literal["up", "refuse", "drop", "silent", "stall"]
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "proxy-connection"})


#: Proxies of this process: a forked child (a DataLoader worker) closes their sockets, or
#: its copy of the listening socket would keep accepting connections that nobody answers
#: after the proxy "refuses" (a black hole instead of a refused connection).
_LIVE: weakref.WeakSet[FaultProxy] = weakref.WeakSet()


def _close_in_child() -> None:
    for proxy in list(_LIVE):
        server = proxy._server
        if server is not None:
            with contextlib.suppress(OSError):
                server.socket.close()


os.register_at_fork(after_in_child=_close_in_child)


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is not None:
            return self.rfile.read(int(length))
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            out = bytearray()
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                out += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return bytes(out)
        return b""

    def _handle(self) -> None:
        proxy = self.server.proxy
        body = self._body()
        proxy.log(Request(self.command, self.path, "range" in {k.lower() for k in self.headers}))
        mode, inject = proxy.decide()
        if mode in ("refuse", "drop"):
            self.close_connection = True
            return
        if mode == "silent":
            proxy.wait_while(mode)
            self.close_connection = True
            return
        if proxy.latency:
            time.sleep(proxy.latency)
        if inject:
            payload = (
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                b"<Message>injected by FaultProxy</Message></Error>"
            )
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        status, headers, data = proxy.forward(self, body)
        self.send_response(status)
        for name, value in headers:
            if name.lower() in _HOP or (
                name.lower() == "content-length" and self.command != "HEAD"
            ):
                continue
            self.send_header(name, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if mode == "stall":
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            proxy.wait_while(mode)
            self.close_connection = True
            return
        self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy


class FaultProxy:
    """Forward ``127.0.0.1:<port>`` to ``target_host:target_port`` (see the module
    docstring). ``url`` is its address; ``mode``, ``latency``, ``error_rate`` may be
    set at any time."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        latency: float = 0.0,
        error_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.target = (target_host, target_port)
        self.latency = latency
        self.error_rate = error_rate
        self.requests: list[Request] = []
        self.injected = 0
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._mode: Mode = "up"
        self._closed = False
        self._local = threading.local()
        self._server: _ProxyServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0
        self._listen()
        self.url = f"http://127.0.0.1:{self.port}"
        _LIVE.add(self)

    def _listen(self) -> None:
        server = _ProxyServer(("127.0.0.1", self.port), _ProxyHandler)
        server.proxy = self
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, name="fault-proxy", daemon=True
        )
        self._thread.start()

    def _unlisten(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    @property
    def mode(self) -> Mode:
        return self._mode

    @mode.setter
    def mode(self, mode: Mode) -> None:
        if mode not in ("up", "refuse", "drop", "silent", "stall"):
            raise ValueError(f"unknown FaultProxy mode {mode!r}")
        with self._cond:
            before, self._mode = self._mode, mode
            self._cond.notify_all()
        if mode == "refuse" and before != "refuse":
            self._unlisten()
        elif before == "refuse" and mode != "refuse" and not self._closed:
            self._listen()

    def log(self, request: Request) -> None:
        with self._cond:
            self.requests.append(request)

    def decide(self) -> tuple[Mode, bool]:
        """The mode for the request just read, and whether to answer it with a 503."""
        with self._cond:
            mode = "refuse" if self._closed else self._mode
            inject = mode == "up" and self.error_rate > 0 and self._rng.random() < self.error_rate
            self.injected += inject
            return mode, inject

    def wait_while(self, mode: Mode) -> None:
        """Block while the proxy is in ``mode`` (and open)."""
        with self._cond:
            while self._mode == mode and not self._closed:
                self._cond.wait(0.5)

    def forward(
        self, handler: BaseHTTPRequestHandler, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        """Send the handler's request upstream (this thread's connection); its answer."""
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP}
        for attempt in range(2):  # an idle upstream connection may have been closed
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(*self.target, timeout=60)
            try:
                conn.request(handler.command, handler.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.getheaders(), data
            except (OSError, http.client.HTTPException):
                conn.close()
                self._local.conn = None
                if attempt:
                    return 502, [], b""
        raise AssertionError("unreachable")  # pragma: no cover

    def object_gets(self, prefix: str = "/") -> list[Request]:
        """The GETs of objects (not listings) whose path starts with ``prefix``."""
        with self._cond:
            seen = list(self.requests)
        return [
            r
            for r in seen
            if r.method == "GET" and r.target.startswith(prefix) and "list-type" not in r.target
        ]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._unlisten()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class _FilesHandler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _FilesServer

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def end_headers(self) -> None:
        path = self.translate_path(self.path)
        if os.path.isfile(path):
            st = os.stat(path)
            self.send_header("ETag", f'"{st.st_size:x}-{st.st_mtime_ns:x}"')
            if self.server.honour_range:  # one that ignores Range says nothing (http.server)
                self.send_header("Accept-Ranges", "bytes")
        super().end_headers()

    def do_GET(self) -> None:
        path = self.translate_path(self.path)
        wanted = _RANGE.match(self.headers.get("Range") or "")
        if not (self.server.honour_range and wanted and os.path.isfile(path)):
            super().do_GET()
            return
        size = os.path.getsize(path)
        start = int(wanted.group(1))
        end = min(int(wanted.group(2)) if wanted.group(2) else size - 1, size - 1)
        if start > end:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        with open(path, "rb") as fh:
            fh.seek(start)
            data = fh.read(end - start + 1)
        self.send_response(206)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _FilesServer(ThreadingHTTPServer):
    daemon_threads = True
    honour_range = True


@dataclass
class HttpFiles:
    """A running :func:`http_files` server: ``url`` (no trailing slash) and its folder."""

    url: str
    root: str
    server: Any

    @property
    def honour_range(self) -> bool:
        """Whether ``Range`` requests are answered ``206`` (settable while it runs)."""
        return bool(self.server.honour_range)

    @honour_range.setter
    def honour_range(self, value: bool) -> None:
        self.server.honour_range = value

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def http_files(root: str | os.PathLike[str], *, honour_range: bool = True) -> Iterator[HttpFiles]:
    """Serve the folder ``root`` on 127.0.0.1 (see the module docstring)."""
    folder = os.fspath(root)

    def handler(*args: Any, **kwargs: Any) -> _FilesHandler:
        return _FilesHandler(*args, directory=folder, **kwargs)

    server = _FilesServer(("127.0.0.1", 0), handler)
    server.honour_range = honour_range
    thread = threading.Thread(target=server.serve_forever, name="http-files", daemon=True)
    thread.start()
    files = HttpFiles(f"http://127.0.0.1:{server.server_address[1]}", folder, server)
    try:
        yield files
    finally:
        with contextlib.suppress(OSError):
            files.stop()
        thread.join(timeout=5)
