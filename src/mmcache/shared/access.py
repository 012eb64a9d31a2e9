"""The I/O of a share: list its indexes, read them and ranges of packs, upload a pack,
commit its index, remove a pack; every call through the one door to object stores,
under the remote retry policy and circuit breaker (:class:`~mmcache.sources.blobs.objects.Remote`).

One mechanism for every location: a local folder (a shared file system) is read as
``file://`` through the blobs layer's local file system, an object store (``s3://``, ``gs://``)
through its own, both by :class:`~mmcache.sources.blobs.objects.Remote` (its ranged reads
are bounded by what was asked, its errors classified, its breaker opens once the store
stops answering). Only the commit differs, by what the location guarantees: a file
system renames a complete temporary file onto the index's name (a rename is atomic), an
object store takes the index in one PUT (an object appears whole or not at all).

Reads of many entries are grouped by pack (:meth:`Share.read_spans`): the entries of a
pack close to each other are read with one ranged GET (spans at most ``_SPAN`` bytes,
gaps under ``_GAP`` read through), and the GETs run on a few threads at once, so a
batch's misses cost about one round trip, not one per entry.

Thread-safe: :class:`Remote` is; the thread pool is made once per process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mmcache.errors import ConfigError, RemoteError
from mmcache.shared.layout import INDEX_DIR, PACK_DIR, index_name, pack_name, pack_of
from mmcache.sources.blobs.objects import Remote, RetryPolicy, is_remote
from mmcache.sources.blobs.options import redact
from mmcache.sources.blobs.ranged import sync_timeout

__all__ = ["Listed", "Share", "Span", "share_url"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Entries of a pack closer than this are read in one GET, the gap read through.
_GAP = 256 << 10
#: The longest span one GET reads.
_SPAN = 16 << 20
#: GETs of one batch in flight at once (per process).
_THREADS = 16


def share_url(location: str | os.PathLike[str]) -> str:
    """The share's URL without a trailing slash: an object store's as given, a local
    folder as ``file://`` and its absolute path."""
    text = os.fspath(location)
    if is_remote(text):
        return text.rstrip("/")
    if text.startswith("file://"):
        text = text.removeprefix("file://")
    path = os.path.abspath(os.path.expanduser(text))
    return "file://" + path.rstrip("/")


@dataclass(frozen=True)
class Listed:
    """A file of the share as a listing shows it: its pack, size and modification time
    (seconds since the epoch; None when the store does not say)."""

    pack: str
    size: int
    mtime: float | None


@dataclass(frozen=True)
class Span:
    """One ranged read of a pack: bytes ``[start, end)``, holding the entries ``parts``
    (``(tag, offset in the span, length)`` each)."""

    pack: str
    start: int
    end: int
    parts: tuple[tuple[int, int, int], ...]


def plan_spans(pack: str, entries: Sequence[tuple[int, int, int]]) -> list[Span]:
    """The ranged reads of ``entries`` (``(tag, offset, size)``) of one pack: sorted by
    offset, neighbours closer than ``_GAP`` merged, no span over ``_SPAN`` bytes (one
    entry bigger than that is its own span)."""
    spans: list[Span] = []
    cur: list[tuple[int, int, int]] = []
    start = end = 0
    for tag, off, size in sorted(entries, key=lambda e: e[1]):
        if cur and off - end <= _GAP and off + size - start <= _SPAN:
            cur.append((tag, off, size))
            end = max(end, off + size)
            continue
        if cur:
            spans.append(_span(pack, start, end, cur))
        cur, start, end = [(tag, off, size)], off, off + size
    if cur:
        spans.append(_span(pack, start, end, cur))
    return spans


def _span(pack: str, start: int, end: int, entries: list[tuple[int, int, int]]) -> Span:
    return Span(pack, start, end, tuple((t, off - start, size) for t, off, size in entries))


class Share:
    """The files of one share, from this process (see the module docstring).

    Pickles as its URL, options and policy; each process makes its own file system.
    """

    def __init__(
        self,
        location: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        retries: int | RetryPolicy = 3,
    ) -> None:
        self.url = share_url(location)
        self.remote = Remote(storage_options, retries=retries)
        self.local = self.url.startswith("file://")
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_pid = -1
        self.filesystem()  # a missing backend (s3fs, gcsfs) is a ConfigError now

    def __repr__(self) -> str:
        return f"Share({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "remote": self.remote, "local": self.local}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pool = None
        self._pool_pid = -1

    # -- plumbing ----------------------------------------------------------------------------
    def filesystem(self) -> tuple[Any, str]:
        """``(fs, path of the share on it)`` in this process."""
        return self.remote.filesystem(self.url)

    def _call(self, relative: str, op: Callable[[Any, str, float | None], T]) -> T:
        """``op(fs, path, timeout)`` on the share's ``relative`` path, retried."""
        fs, root = self.filesystem()
        path = f"{root}/{relative}"
        return self.remote.attempt(f"{self.url}/{relative}", lambda left: op(fs, path, left))

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    _THREADS, thread_name_prefix="mmcache-shared-read"
                )
                self._pool_pid = os.getpid()
            return self._pool

    def close(self) -> None:
        """Stop this process's read threads (idempotent)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pool_pid == os.getpid():
            pool.shutdown(wait=False)

    # -- listing and reading ----------------------------------------------------------------
    def _list(self, folder: str, suffix: str) -> list[Listed]:
        def ls(fs: Any, path: str, left: float | None) -> list[dict[str, Any]]:
            fs.invalidate_cache(path)
            try:
                out: list[dict[str, Any]] = fs.ls(path, detail=True, **sync_timeout(fs, left))
            except FileNotFoundError:  # nothing committed yet
                return []
            return out

        found = []
        for entry in self._call(folder, ls):
            pack = pack_of(str(entry.get("name", "")), suffix=suffix)
            if pack is None or entry.get("type") == "directory":
                continue
            found.append(Listed(pack, int(entry.get("size") or 0), _mtime(entry)))
        return found

    def list_indexes(self) -> list[Listed]:
        """The committed indexes (one listing)."""
        return self._list(INDEX_DIR, ".idx")

    def list_packs(self) -> list[Listed]:
        """The packs, committed or not (one listing; what ``gc`` sweeps)."""
        return self._list(PACK_DIR, ".pack")

    def read_index(self, listed: Listed) -> bytes:
        """The whole index file of ``listed`` (its listed size, read bounded)."""
        return self.remote.read(f"{self.url}/{index_name(listed.pack)}", 0, listed.size)

    def read_indexes(self, listed: Sequence[Listed]) -> list[bytes | RemoteError]:
        """:meth:`read_index` of each, on the read threads; a failed one is its error."""
        return self._each(listed, self.read_index)

    def read_span(self, span: Span) -> bytes:
        """The bytes of one span of a pack."""
        return self.remote.read(f"{self.url}/{pack_name(span.pack)}", span.start, span.end)

    def read_spans(self, spans: Sequence[Span]) -> list[bytes | RemoteError]:
        """:meth:`read_span` of each, on the read threads; a failed one is its error."""
        return self._each(spans, self.read_span)

    def _each(self, items: Sequence[Any], fn: Callable[[Any], bytes]) -> list[bytes | RemoteError]:
        def one(item: Any) -> bytes | RemoteError:
            try:
                return fn(item)
            except RemoteError as err:
                return err

        if len(items) <= 1:
            return [one(item) for item in items]
        return list(self._threads().map(one, items))

    # -- writing ----------------------------------------------------------------------------
    def upload(self, spool: str, pack: str) -> None:
        """Copy the spool file ``spool`` to the pack ``pack`` (not visible yet)."""

        def put(fs: Any, path: str, left: float | None) -> None:
            if self.local:
                fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(spool, path)

        self._call(pack_name(pack), put)

    def commit(self, pack: str, index: bytes) -> None:
        """Make ``pack`` visible: its index written whole (see the module docstring)."""
        name = index_name(pack)

        def rename(fs: Any, path: str, left: float | None) -> None:
            folder = path.rsplit("/", 1)[0]
            fs.makedirs(folder, exist_ok=True)
            tmp = f"{folder}/.{pack}.tmp"
            fs.pipe_file(tmp, index)
            fs.mv(tmp, path)

        def put(fs: Any, path: str, left: float | None) -> None:
            fs.pipe_file(path, index, **sync_timeout(fs, left))

        self._call(name, rename if self.local else put)

    def remove(self, pack: str) -> None:
        """Remove ``pack``: its index first (so no reader finds it), then its bytes."""
        for name in (index_name(pack), pack_name(pack)):

            def rm(fs: Any, path: str, left: float | None) -> None:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm_file(path)

            self._call(name, rm)

    def describe(self) -> str:
        """The URL with any credentials in it hidden (for messages)."""
        return str(redact(self.url, self.remote.storage_options))


def _mtime(entry: dict[str, Any]) -> float | None:
    for field in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = entry.get(field)
        if isinstance(value, (int, float)):
            return float(value)
        stamp = getattr(value, "timestamp", None)
        if callable(stamp):
            return float(stamp())
    return None


def check_location(location: object) -> str | os.PathLike[str]:
    """``location`` if it can name a share (a path or URL), else a ConfigError."""
    if isinstance(location, (str, os.PathLike)) and os.fspath(location):
        return location
    raise ConfigError(
        f"a shared tier is a folder on a shared file system or a URL such as "
        f"s3://bucket/prefix, got {location!r}"
    )
