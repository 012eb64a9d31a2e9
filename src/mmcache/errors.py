"""The exceptions mmcache raises.

A small hierarchy: every class derives from :class:`MmcacheError` *and* from the
built-in type that callers already catch, so ``except ValueError`` around a
manifest read, or ``except OSError`` around cache I/O, keeps working.

Messages always carry the offending value and, where there is one, the fix.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "CacheError",
    "ConfigError",
    "CorruptEntryError",
    "ManifestError",
    "MmcacheError",
    "RemoteError",
    "RemoteErrorKind",
    "RemoteSampleError",
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


#: What went wrong with a remote call (:attr:`RemoteError.kind`): the object is not there
#: (``"not-found"``), not ours to read (``"denied"``), the request was refused for another
#: reason (``"refused"``: a 4xx), the server failed (``"server"``: a 5xx) or asks us to slow
#: down (``"throttled"``: 429, 503 SlowDown), no answer came (``"unreachable"``: a refused or
#: dropped connection; ``"timeout"``: the call's deadline passed), the server sent other bytes
#: than asked (``"range-ignored"``: it does not honour ``Range``; ``"short-read"``: fewer),
#: the circuit breaker is open (``"circuit-open"``: the store stopped answering, calls fail at
#: once until a probe answers) or the source is offline (``"offline"``: never contacted).
RemoteErrorKind = Literal[
    "not-found",
    "denied",
    "refused",
    "server",
    "throttled",
    "unreachable",
    "timeout",
    "range-ignored",
    "short-read",
    "circuit-open",
    "offline",
]
_KINDS = frozenset(get_args(RemoteErrorKind))


def _kind_of(status: int | None, permanent: bool) -> RemoteErrorKind:
    if status is None:
        return "refused" if permanent else "unreachable"
    if status in (404, 410):
        return "not-found"
    if status in (401, 403):
        return "denied"
    if status in (429, 503):
        return "throttled"
    return "server" if status >= 500 else "refused"


class RemoteError(MmcacheError):
    """A remote call (listing, HEAD, ranged GET) that failed, after mmcache's retries.

    Attributes: ``url``, the HTTP ``status`` (``None`` when no response came), whether it
    is ``permanent`` (404, 403, a server ignoring ``Range``: retrying cannot help),
    ``kind`` (a :data:`RemoteErrorKind`) and the ``reason`` (credentials redacted).
    Not an ``OSError``, so the retry loops that catch ``OSError`` around object store calls never
    take a permanent failure for a transient one. Picklable (workers send it to the parent).
    """

    def __init__(
        self,
        url: str,
        status: int | None,
        permanent: bool,
        reason: str,
        *,
        kind: RemoteErrorKind | None = None,
    ) -> None:
        if kind is not None and kind not in _KINDS:
            raise ValueError(f"unknown RemoteError kind {kind!r}")
        self.url = url
        self.status = status
        self.permanent = permanent
        self.reason = reason
        self.kind: RemoteErrorKind = kind or _kind_of(status, permanent)
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"{self.url}: {_answered(self.status, self.kind)}: {self.reason}"

    @property
    def no_response(self) -> bool:
        """Whether no whole answer came: the connection failed, or the call's deadline
        passed (perhaps after the server began to answer: then :attr:`status` is set).
        What the circuit breaker counts."""
        return self.kind in ("unreachable", "timeout")

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_remote_error,
            (self.url, self.status, self.permanent, self.reason, self.kind),
        )


def _answered(status: int | None, kind: RemoteErrorKind) -> str:
    """What the server answered, for messages: ``"HTTP 200"``; ``"answered"`` when it
    answered with other bytes than asked (G24: not "no response") but the status is not
    known; else ``"no response"``."""
    if status is not None:
        return f"HTTP {status}"
    return "answered" if kind in ("range-ignored", "short-read") else "no response"


def _rebuild_remote_error(
    url: str, status: int | None, permanent: bool, reason: str, kind: RemoteErrorKind
) -> RemoteError:
    return RemoteError(url, status, permanent, reason, kind=kind)


class RemoteSampleError(SampleError, RemoteError):
    """A sample whose bytes could not be fetched: both a :class:`SampleError` (naming the
    sample, skipped and listed under ``on_error="skip"``) and a :class:`RemoteError` (the
    URL, status and kind of the failed call), so ``except RemoteError`` catches it too."""

    def __init__(self, err: RemoteError, *, sample_id: str) -> None:
        status = _answered(err.status, err.kind)
        self.url = err.url
        self.status = err.status
        self.permanent = err.permanent
        self.kind = err.kind
        self.remote_reason = err.reason
        # SampleError's fields, set here: its __init__ would chain to RemoteError's.
        self.reason = f"cannot fetch {err.url} ({status}, {err.kind}): {err.reason}"
        self.sample_id = sample_id
        self.path = err.url
        self._message = f"sample {sample_id!r} ({err.url}): {self.reason}"
        Exception.__init__(self, self._message)

    def __str__(self) -> str:
        return self._message

    def __reduce__(self) -> tuple[object, ...]:
        err = RemoteError(self.url, self.status, self.permanent, self.remote_reason, kind=self.kind)
        return (_rebuild_remote_sample_error, (err, self.sample_id))


def _rebuild_remote_sample_error(err: RemoteError, sample_id: str) -> RemoteSampleError:
    return RemoteSampleError(err, sample_id=sample_id)
