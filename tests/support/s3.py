"""A local S3-compatible server for tests and benchmarks, and a TCP proxy that adds latency.

:func:`moto_s3` starts moto's ``ThreadedMotoServer`` on 127.0.0.1 and a free port and
yields an :class:`S3Endpoint` (its URL, a boto3 client, the ``storage_options`` that make
``s3://`` URLs read from it); the server is stopped on exit (or earlier by
:meth:`S3Endpoint.stop`, to play an outage). :class:`DelayProxy` forwards a local port to
another, sleeping ``delay`` seconds before it forwards each chunk a client sends (one
request, for the small GETs of a source), which is how a store tens of milliseconds away
behaves. It also records the requests it forwards (:attr:`DelayProxy.requests`: method,
target and whether a ``Range`` header was sent), so that tests and benchmarks can count
the GETs a source issues. Nothing leaves the machine.

Needs ``moto[server]`` and ``boto3`` (``pip install 'mmcache[s3-server]'``), imported
lazily. Thread-safe: the proxy runs one thread per direction of each connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DelayProxy", "Request", "S3Endpoint", "free_port", "moto_s3"]

KEY = SECRET = "testing"  # moto accepts any credentials
REGION = "us-east-1"

_REQUEST = re.compile(rb"(?:^|(?<=\r\n\r\n))([A-Z]+) (\S+) HTTP/1\.[01]\r\n((?:.+\r\n)*?)\r\n")


@dataclass(frozen=True)
class Request:
    """One request a :class:`DelayProxy` forwarded."""

    method: str
    target: str
    ranged: bool


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class S3Endpoint:
    """A running local S3 server: ``url``, a boto3 ``client``, and how to stop it."""

    url: str
    client: Any
    server: Any
    stopped: bool = field(default=False)

    def storage_options(self, url: str | None = None, *, attempts: int = 1) -> dict[str, Any]:
        """fsspec options for ``s3://`` at ``url`` (default this server's; a proxy's URL
        to read through it); botocore's own retries set to ``attempts`` (mmcache retries)."""
        return {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": url or self.url, "region_name": REGION},
            "config_kwargs": {
                "retries": {"total_max_attempts": attempts, "mode": "standard"},
                "connect_timeout": 2,
                "read_timeout": 10,
            },
        }

    def upload(self, paths: Sequence[str | os.PathLike[str]], prefix: str = "wds") -> list[str]:
        """Upload each local file as ``<prefix>/<its name>`` in bucket ``data``; their URLs."""
        urls = []
        for path in paths:
            name = os.path.basename(os.fspath(path))
            self.client.upload_file(os.fspath(path), "data", f"{prefix}/{name}")
            urls.append(f"s3://data/{prefix}/{name}")
        return urls

    def stop(self) -> None:
        if not self.stopped:
            self.server.stop()
            self.stopped = True


@contextlib.contextmanager
def moto_s3(bucket: str = "data") -> Iterator[S3Endpoint]:
    """A moto S3 server with ``bucket`` created (see the module docstring)."""
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError as exc:  # pragma: no cover - declared by the s3-server extra
        raise ImportError("a local S3 server needs pip install 'mmcache[s3-server]'") from exc
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        region_name=REGION,
    )
    client.create_bucket(Bucket=bucket)
    endpoint = S3Endpoint(url, client, server)
    try:
        yield endpoint
    finally:
        endpoint.stop()


def s3_client(url: str) -> Any:
    """A boto3 S3 client of the moto server at ``url`` (its test credentials)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=url,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        region_name=REGION,
    )


@contextlib.contextmanager
def moto_process(bucket: str = "data") -> Iterator[str]:
    """moto's S3 server in a process of its own (so that it does not share the caller's
    GIL, as benchmarks want), with ``bucket`` created; yields its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        client = s3_client(url)
        for _ in range(100):
            try:
                client.list_buckets()
                break
            except Exception:  # not listening yet
                time.sleep(0.1)
        client.create_bucket(Bucket=bucket)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


class DelayProxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` with ``delay`` seconds added to each
    chunk sent by a client (see the module docstring). ``url`` is its address;
    ``requests`` what it forwarded (thread-safe to read; :meth:`object_gets` counts)."""

    def __init__(self, target_host: str, target_port: int, *, delay: float) -> None:
        self.target = (target_host, target_port)
        self.delay = delay
        self._listen = socket.socket()
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind(("127.0.0.1", 0))
        self._listen.listen(128)
        self.port: int = self._listen.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self.requests: list[Request] = []
        self._thread = threading.Thread(target=self._accept, name="delay-proxy", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst, delay, log in (
                (client, upstream, self.delay, self.requests),
                (upstream, client, 0.0, None),
            ):
                args = (src, dst, delay, log)
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def object_gets(self, prefix: str = "/") -> list[Request]:
        """The GETs of objects (not listings: no ``?list-type``) whose path starts with
        ``prefix`` (``/bucket/key-prefix``)."""
        return [
            r
            for r in list(self.requests)
            if r.method == "GET" and r.target.startswith(prefix) and "list-type" not in r.target
        ]

    @staticmethod
    def _pump(
        src: socket.socket, dst: socket.socket, delay: float, log: list[Request] | None
    ) -> None:
        try:
            while data := src.recv(1 << 20):
                if log is not None:  # a request's headers arrive in one chunk here
                    for m in _REQUEST.finditer(data):
                        headers = b"\r\n" + m.group(3).lower()
                        ranged = b"\r\nrange:" in headers
                        log.append(Request(m.group(1).decode(), m.group(2).decode(), ranged))
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listen.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()
            self._sockets = []

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
