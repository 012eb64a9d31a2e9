"""Objects behind fsspec (``s3://``, ``gs://``, ``http(s)://``...): opening the file system,
ranged reads with retries, batched stamps (ETags), and what an error means.

- :func:`is_remote` tells a URL from a local path (``file://`` counts as local);
- :class:`Remote` is the per-process access to one URL scheme with the user's
  ``storage_options``: a file system made lazily in each process (never pickled: an
  s3fs instance owns an event loop thread, which a forked or spawned worker must not
  share), :meth:`Remote.read` (a ranged GET, retried with backoff on transient errors),
  :meth:`Remote.stamps` (each object's ETag or version, batched: one listing per
  directory, ``info`` only for what a listing does not show);
- :class:`RemoteError` is what a failed call becomes: the URL, the HTTP status where
  known, and whether it is ``permanent`` (404, 403: retrying cannot help) or transient
  (5xx, timeouts, throttling, a refused connection).

fsspec and the scheme's package (``s3fs``, ``gcsfs``, ``aiohttp`` for HTTP) are imported
lazily; a missing one is a :class:`~mmcache.errors.ConfigError` naming the extra.

Thread-safe: fsspec's sync calls may be made from many threads (they are submitted to
the file system's own event loop); the per-process file system is made under a lock.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from mmcache.errors import ConfigError, RemoteError

__all__ = ["Remote", "RemoteError", "is_remote", "object_stamp"]

logger = logging.getLogger(__name__)

#: Extras that provide each scheme's file system (for the error of a missing one).
_EXTRA = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "s3", "https": "s3"}

#: HTTP statuses that retrying cannot fix.
_PERMANENT = frozenset({400, 401, 403, 404, 405, 410, 412, 416})


def is_remote(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is a URL of a remote file system (``scheme://``, not ``file://``)."""
    text = os.fspath(location)
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.isidentifier() and scheme.lower() not in ("file", "local")


# RemoteError lives in mmcache.errors, in the one hierarchy; imported above.


def _status(exc: BaseException) -> int | None:
    """The HTTP status of ``exc`` or of the exception it was translated from, if any."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            break
        response = getattr(seen, "response", None)
        if isinstance(response, Mapping):
            code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(code, int):
                return code
        status = getattr(seen, "status", None) or getattr(seen, "code", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
        seen = seen.__cause__ or seen.__context__
    return None


def classify(url: str, exc: BaseException) -> RemoteError:
    """``exc`` raised by a call on ``url`` as a :class:`RemoteError` (see its fields)."""
    status = _status(exc)
    if isinstance(exc, FileNotFoundError):
        status = status or 404
    elif isinstance(exc, PermissionError):
        status = status or 403
    permanent = status in _PERMANENT if status is not None else False
    if isinstance(exc, OSError) and exc.errno in (errno.ENOENT, errno.EACCES, errno.EPERM):
        permanent = True
    reason = f"{type(exc).__name__}: {exc}".strip()
    return RemoteError(url, status, permanent, reason[:500])


def object_stamp(info: Mapping[str, Any]) -> str | None:
    """The version stamp of an object from its fsspec ``info``/``ls`` entry: its ETag
    (S3, HTTP), generation (GCS) or version id, else ``None`` (no change detector)."""
    for field in ("ETag", "etag", "generation", "VersionId", "version_id", "md5Hash"):
        value = info.get(field)
        if value not in (None, ""):
            return f"{field}={str(value).strip(chr(34))}"
    return None


class Remote:
    """Access to remote objects of one ``storage_options`` from this process.

    Args:
        storage_options: passed to fsspec's file system as they are (credentials,
            ``client_kwargs={"endpoint_url": ...}``, ``anon``...).
        retries: attempts after the first on a transient error (5xx, throttling,
            timeouts, a connection refused).
        backoff: seconds before the first retry; doubled each time (plus up to 50%
            jitter-free extra: deterministic, for tests), capped at 5 s.
        sleep: the sleep function (tests pass a fake one).

    Pickles as its options; each process opens its own file system on first use.
    """

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retries: int = 4,
        backoff: float = 0.1,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.storage_options = dict(storage_options or {})
        try:
            json.dumps(self.storage_options, default=repr)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"storage_options must be a dict, got {storage_options!r}") from exc
        if not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"retries must be an int >= 0, got {retries!r}")
        self.retries = retries
        self.backoff = float(backoff)
        self.sleep = sleep
        self._lock = threading.Lock()
        self._fs: dict[tuple[int, str], Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {
            "storage_options": self.storage_options,
            "retries": self.retries,
            "backoff": self.backoff,
            "sleep": self.sleep,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._fs = {}

    def filesystem(self, url: str) -> tuple[Any, str]:
        """``(fs, path)`` of ``url`` in this process (made once per scheme and process)."""
        scheme = url.partition("://")[0].lower()
        try:
            import fsspec
        except ImportError as exc:  # pragma: no cover - fsspec ships with every extra
            raise ConfigError(
                f"reading {url} needs fsspec: pip install 'mmcache[{_EXTRA.get(scheme, 's3')}]'"
            ) from exc
        slot = (os.getpid(), scheme)
        with self._lock:
            fs = self._fs.get(slot)
            if fs is None:
                try:
                    cls = fsspec.get_filesystem_class(scheme)
                except (ImportError, ValueError) as exc:
                    extra = _EXTRA.get(scheme)
                    hint = f": pip install 'mmcache[{extra}]'" if extra else ""
                    raise ConfigError(f"cannot read {url}: {exc}{hint}") from exc
                # skip_instance_cache: a fork or another source with other options
                # never gets this instance (and its event loop) by accident.
                fs = cls(skip_instance_cache=True, **self.storage_options)
                self._fs[slot] = fs
        return fs, fs._strip_protocol(url)

    def call(self, url: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` retried on transient errors; a :class:`RemoteError` when it gives up."""
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except Exception as exc:  # every error of every fsspec backend is classified
                err = classify(url, exc)
                if err.permanent or attempt == self.retries:
                    raise err from exc
                logger.debug("retrying %s after %s", url, err)
                self.sleep(min(delay, 5.0))
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def read(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object at ``url`` (one ranged GET, retried)."""
        fs, path = self.filesystem(url)
        data = self.call(url, lambda: fs.cat_file(path, start=start, end=end))
        if len(data) != end - start:
            raise RemoteError(
                url, None, False, f"short read: {len(data)} of {end - start} bytes at {start}"
            )
        return bytes(data)

    def open(self, url: str, *, block_size: int = 8 << 20) -> Any:
        """A seekable binary file of ``url`` (read-ahead in ``block_size`` blocks)."""
        fs, path = self.filesystem(url)
        return self.call(url, lambda: fs.open(path, "rb", block_size=block_size))

    def info(self, url: str) -> dict[str, Any]:
        """The object's fsspec ``info`` (size, ETag...), fresh (never from a listing cache)."""
        fs, path = self.filesystem(url)

        def fresh() -> dict[str, Any]:
            fs.invalidate_cache(path)
            out: dict[str, Any] = fs.info(path)
            return out

        info: dict[str, Any] = self.call(url, fresh)
        return info

    def stamps(self, urls: Sequence[str]) -> dict[str, tuple[int, str | None] | RemoteError]:
        """``url -> (size, stamp)`` of many objects, batched: one fresh listing of each
        directory holding several of them, ``info`` for the rest; an object that cannot
        be found or read maps to its permanent :class:`RemoteError` (404, 403). Raises
        :class:`RemoteError` when the store cannot be reached (a transient error that
        outlived the retries)."""
        by_dir: dict[str, list[str]] = {}
        for url in urls:
            by_dir.setdefault(url.rsplit("/", 1)[0], []).append(url)
        out: dict[str, tuple[int, str | None] | RemoteError] = {}
        for directory, members in by_dir.items():
            if len(members) > 1:
                fs, path = self.filesystem(directory)

                def listing(fs: Any = fs, path: str = path) -> list[dict[str, Any]]:
                    fs.invalidate_cache(path)
                    entries: list[dict[str, Any]] = fs.ls(path, detail=True)
                    return entries

                try:
                    entries = self.call(directory, listing)
                except RemoteError as err:
                    if not err.permanent:
                        raise
                    entries = []  # not listable (no permission, not a directory): one by one
                names = {fs._strip_protocol(e["name"]): e for e in entries}
                for url in members:
                    entry = names.get(fs._strip_protocol(url))
                    if entry is not None and object_stamp(entry) is not None:
                        out[url] = (int(entry.get("size") or 0), object_stamp(entry))
            for url in members:
                if url not in out:
                    try:
                        info = self.info(url)
                    except RemoteError as err:
                        if not err.permanent:
                            raise
                        out[url] = err
                        continue
                    out[url] = (int(info.get("size") or 0), object_stamp(info))
        return out
