"""A local Google Cloud Storage server for tests and benchmarks.

:func:`gcs_emulator` starts ``gcp-storage-emulator`` (an in-memory implementation of
the GCS JSON API) on 127.0.0.1 and a free port, with one bucket, and yields a
:class:`GcsEndpoint`: its URL, a ``gcsfs`` file system to upload with, and the
``storage_options`` that make ``gs://`` URLs read from it. The server is stopped on
exit (or earlier by :meth:`GcsEndpoint.stop`, to play an outage). Nothing leaves
the machine.

gcsfs >= 2026.7 asks Google's gRPC storage-control service for each bucket's type
(zonal/hierarchical) first and waits 60 s for an answer the emulator cannot give;
this module turns that probe off for the process and its child processes when it is
imported (``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false``, read by gcsfs when it is first
imported; if gcsfs was imported before, :func:`gcs_emulator` registers gcsfs's plain
file system for ``gs://`` with fsspec). The probe only matters for buckets with a
hierarchical namespace, which the emulator has none of. A user pointing gcsfs at
another emulator or a proxy needs the same variable.

Needs ``gcp-storage-emulator`` and ``gcsfs`` (``pip install 'mmcache[gcs,gcs-server]'``),
imported lazily. Thread-safe: the emulator serves each request in its own thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from support.s3 import free_port

__all__ = ["GcsEndpoint", "gcs_emulator"]

PROJECT = "mmcache-test"
_PROBE_ENV = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
os.environ.setdefault(_PROBE_ENV, "false")


@dataclass
class GcsEndpoint:
    """A running local GCS server: ``url``, a gcsfs ``fs`` on it, and how to stop it."""

    url: str
    bucket: str
    fs: Any
    server: Any
    stopped: bool = field(default=False)

    def storage_options(self) -> dict[str, Any]:
        """fsspec options for ``gs://`` URLs on this server (anonymous access).

        gcsfs retries each failed request itself, 6 times with backoff (about 31 s,
        not configurable per file system), before mmcache's own retries see the error.
        """
        return {"endpoint_url": self.url, "token": "anon", "project": PROJECT}

    def upload(self, local: str | os.PathLike[str], key: str) -> str:
        """Upload the file ``local`` as ``key`` in the bucket; return its ``gs://`` URL."""
        path = f"{self.bucket}/{key}"
        self.fs.put_file(os.fspath(local), path)
        self.fs.invalidate_cache()
        return f"gs://{path}"

    def stop(self) -> None:
        if not self.stopped:
            self.server.stop()
            self.stopped = True


@contextlib.contextmanager
def gcs_emulator(bucket: str = "data") -> Iterator[GcsEndpoint]:
    """A local GCS server with ``bucket`` created (see the module docstring)."""
    try:
        import fsspec
        import gcsfs
        import gcsfs.core
        from gcp_storage_emulator.server import create_server
    except ImportError as exc:  # pragma: no cover - declared by the gcs-server extra
        raise ImportError("a local GCS server needs pip install 'mmcache[gcs,gcs-server]'") from exc
    # The emulator logs each request and each client that hangs up early at INFO/ERROR.
    for name in ("gcp_storage_emulator", "gcp_storage_emulator.server"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:  # imported before this module
        for protocol in ("gs", "gcs"):
            fsspec.register_implementation(protocol, gcsfs.core.GCSFileSystem, clobber=True)
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    url = f"http://127.0.0.1:{port}"
    fs = gcsfs.core.GCSFileSystem(
        endpoint_url=url,
        token="anon",  # anonymous access to the local emulator
        project=PROJECT,
        skip_instance_cache=True,
    )
    endpoint = GcsEndpoint(url, bucket, fs, server)
    try:
        yield endpoint
    finally:
        endpoint.stop()
