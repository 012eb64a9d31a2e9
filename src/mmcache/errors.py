"""The exceptions mmcache raises.

A small hierarchy: every class derives from :class:`MmcacheError` *and* from the
built-in type that callers already catch, so ``except ValueError`` around a
manifest read, or ``except OSError`` around cache I/O, keeps working.

Messages always carry the offending value and, where there is one, the fix.
"""

from __future__ import annotations

__all__ = [
    "CacheError",
    "ConfigError",
    "CorruptEntryError",
    "ManifestError",
    "MmcacheError",
    "RemoteError",
    "SampleError",
]


class MmcacheError(Exception):
    """Base class of every error raised by mmcache."""


class ConfigError(MmcacheError, ValueError):
    """An argument or option has an invalid value (the message names it and the valid range)."""


class ManifestError(MmcacheError, ValueError):
    """A manifest record is malformed.

    Attributes name where: ``path`` (the manifest file), ``line`` (1-based line for
    JSONL, 1-based record index for JSON arrays; ``None`` for whole-file problems),
    ``sample_id`` (when it could be read) and ``reason``.
    """

    def __init__(
        self,
        reason: str,
        *,
        path: str,
        line: int | None = None,
        sample_id: str | None = None,
    ) -> None:
        self.reason = reason
        self.path = path
        self.line = line
        self.sample_id = sample_id
        where = path if line is None else f"{path}:{line}"
        ident = "" if sample_id is None else f" (id {sample_id!r})"
        super().__init__(f"{where}{ident}: {reason}")

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only constructors do not survive pickling by default; DataLoader
        # workers send exceptions to the parent, so make them round-trip.
        return (_rebuild_manifest_error, (self.reason, self.path, self.line, self.sample_id))


def _rebuild_manifest_error(
    reason: str, path: str, line: int | None, sample_id: str | None
) -> ManifestError:
    return ManifestError(reason, path=path, line=line, sample_id=sample_id)


class SampleError(MmcacheError, ValueError):
    """A sample cannot be produced: its image is missing, unreadable or too large, etc.

    Attributes: ``sample_id``, ``path`` (the image file, when there is one) and ``reason``.
    """

    def __init__(self, reason: str, *, sample_id: str, path: str | None = None) -> None:
        self.reason = reason
        self.sample_id = sample_id
        self.path = path
        where = "" if path is None else f" ({path})"
        super().__init__(f"sample {sample_id!r}{where}: {reason}")

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_sample_error, (self.reason, self.sample_id, self.path))


def _rebuild_sample_error(reason: str, sample_id: str, path: str | None) -> SampleError:
    return SampleError(reason, sample_id=sample_id, path=path)


class CacheError(MmcacheError, OSError):
    """The cache cannot be opened or used (permissions, missing /dev/shm, disk full...)."""


class CorruptEntryError(CacheError):
    """A stored entry failed its header or checksum verification; it is never served."""


class RemoteError(MmcacheError):
    """A remote call that failed: ``url``, HTTP ``status`` (``None`` when no response came:
    a refused connection, a timeout), ``permanent`` (404/403...) and the reason.

    Raised by the remote sources (S3, GCS, HTTP through fsspec); a sample that cannot be
    fetched reaches the training loop as a :class:`SampleError` naming the URL. Not an
    ``OSError``, so the retry loops that catch ``OSError`` around fsspec calls never take
    a permanent failure for a transient one. Picklable (workers send it to the parent).
    """

    def __init__(self, url: str, status: int | None, permanent: bool, reason: str) -> None:
        super().__init__(url, status, permanent, reason)
        self.url = url
        self.status = status
        self.permanent = permanent
        self.reason = reason

    def __str__(self) -> str:
        status = f"HTTP {self.status}" if self.status is not None else "no response"
        return f"{self.url}: {status}: {self.reason}"
