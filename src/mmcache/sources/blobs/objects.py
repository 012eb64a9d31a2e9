"""Objects behind fsspec (``s3://``, ``gs://``, ``http(s)://``...): opening the file system,
ranged reads under one retry policy, batched stamps (ETags), what an error means, and
what is done when the store cannot be reached.

- :func:`is_remote` tells a URL from a local path (``file://`` counts as local);
- :class:`Remote` is the per-process access to one URL scheme with the user's
  ``storage_options``: a file system made lazily in each process (never pickled: an
  s3fs instance owns an event loop thread, which a forked or spawned worker must not
  share), :meth:`Remote.read` (a ranged GET), :meth:`Remote.stamps` (each object's ETag
  or version, batched: one listing per directory, ``info`` only for what a listing does
  not show). Every call goes through :meth:`Remote.attempt`: the
  :class:`~mmcache.sources.blobs.retry.RetryPolicy` (tries, backoff, a deadline per call
  and per epoch) and the process's circuit breaker; the file system below is told to
  make one attempt per call (:mod:`~mmcache.sources.blobs.options`);
- :class:`~mmcache.errors.RemoteError` is what a failed call becomes: the URL, the HTTP
  status where known, its ``kind`` and whether it is ``permanent`` (404, 403, a server
  ignoring ``Range``: retrying cannot help) or transient (5xx, timeouts, throttling, a
  refused connection);
- ``offline``: when the store cannot be reached, :meth:`Remote.stamps` answers from the
  last listing kept in ``listing_dir`` (:mod:`~mmcache.sources.blobs.listing`):
  ``"auto"`` (warn once, :attr:`Remote.stale` is then true), ``True`` (never contact the
  store: every call fails at once, kind ``"offline"``), ``False`` (raise).

fsspec and the scheme's package (``s3fs``, ``gcsfs``, ``aiohttp`` for HTTP) are imported
lazily; a missing one is a :class:`~mmcache.errors.ConfigError` naming the extra.

Thread-safe: fsspec's sync calls may be made from many threads (they are submitted to
the file system's own event loop); the per-process file system is made under a lock.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

from mmcache.errors import ConfigError, RemoteError, RemoteErrorKind
from mmcache.sources.blobs.listing import Entry, ListingFile
from mmcache.sources.blobs.options import backend_options, check_options, quiet_retries, redact
from mmcache.sources.blobs.ranged import Answer, ranged_get, sync_timeout
from mmcache.sources.blobs.retry import CircuitBreaker, RetryPolicy
from mmcache.sources.identity import CONTENT_PREFIX

__all__ = [
    "Offline",
    "Remote",
    "RemoteError",
    "RetryPolicy",
    "byte_identity",
    "is_remote",
    "object_identity",
    "object_stamp",
]

T = TypeVar("T")

#: What a source does when the store cannot be reached (see the module docstring).
Offline = Literal["auto"] | bool

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


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or during (four at most)."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return
        yield seen
        seen = seen.__cause__ or seen.__context__


def _status(exc: BaseException) -> int | None:
    """The HTTP status of ``exc`` or of the exception it was translated from, if any."""
    for seen in _chain(exc):
        response = getattr(seen, "response", None)
        if isinstance(response, Mapping):
            code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(code, int):
                return code
        status = getattr(seen, "status", None) or getattr(seen, "code", None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
    return None


def _timed_out(exc: BaseException) -> bool:
    return any(
        isinstance(seen, (TimeoutError, asyncio.TimeoutError)) or "Timeout" in type(seen).__name__
        for seen in _chain(exc)
    )


def _connecting(exc: BaseException) -> bool:
    """Whether ``exc`` came while connecting (botocore's ``ConnectTimeoutError``,
    aiohttp's ``ConnectionTimeoutError``, a refused connection): the store, not one
    object, did not answer."""
    return any("Connect" in type(seen).__name__ for seen in _chain(exc))


def classify(url: str, exc: BaseException, options: Mapping[str, Any] | None = None) -> RemoteError:
    """``exc`` raised by a call on ``url`` as a :class:`RemoteError` (see its fields); the
    reason has the credentials of ``options`` redacted."""
    if isinstance(exc, RemoteError):
        return exc
    status = _status(exc)
    if isinstance(exc, FileNotFoundError):
        status = status or 404
    elif isinstance(exc, PermissionError):
        status = status or 403
    permanent = status in _PERMANENT if status is not None else False
    if isinstance(exc, OSError) and exc.errno in (errno.ENOENT, errno.EACCES, errno.EPERM):
        permanent = True
    reason = redact(f"{type(exc).__name__}: {exc}".strip(), options)
    kind: RemoteErrorKind | None = None
    if status is None and not permanent and _timed_out(exc):
        kind = "timeout"
    return RemoteError(url, status, permanent, reason[:500], kind=kind)


def object_stamp(info: Mapping[str, Any]) -> str | None:
    """The version stamp of an object from its fsspec ``info``/``ls`` entry: its ETag
    (S3, HTTP), generation (GCS) or version id, else ``None`` (no change detector)."""
    for field in ("ETag", "etag", "generation", "VersionId", "version_id", "md5Hash"):
        value = info.get(field)
        if value not in (None, ""):
            return f"{field}={str(value).strip(chr(34))}"
    return None


#: An S3 ETag that is a function of the object's bytes: the MD5 of a single-part upload
#: (32 hex) or, for a multipart one, the MD5 of its parts' MD5s and their count.
_S3_CONTENT_ETAG = re.compile(r"ETag=([0-9a-f]{32}(?:-[1-9][0-9]{0,4})?)")


def byte_identity(url: str, stamp: str | None) -> str | None:
    """The identity of an object's bytes that does not name where the object is, when its
    ``stamp`` (:func:`object_stamp`, or a digest of the fetched bytes) is one; else ``None``
    (the stamp only tells versions of *this* object apart, so the key keeps the URL).

    - ``"xxh3:<hex>"`` (:func:`~mmcache.sources.identity.content_digest` of the bytes,
      the stamp of an object whose server gives no ETag): itself.
    - an ``s3://`` ETag of 32 hex digits, optionally ``-<parts>``: ``"s3-etag:<etag>"``.
      S3 computes it from the bytes (the MD5 of a single-part upload; of the parts' MD5s
      for a multipart one), so equal bytes under another bucket or prefix, a copy made
      with ``aws s3 cp``/``sync`` or ``CopyObject``, give the same key and other bytes
      another one. A multipart ETag depends on the part sizes too: equal bytes uploaded
      in other parts give another key (a miss, never wrong data). SSE-KMS/SSE-C ETags
      are not an MD5 but are still per object (other bytes never share one).

    Not location-free, on purpose: HTTP ETags (servers derive many from inode, size and
    mtime: two files of equal size and mtime on two servers share one, G4), GCS
    generations and etags, S3 version ids (a version, not the bytes).
    """
    if stamp is None:
        return None
    if stamp.startswith(CONTENT_PREFIX):
        return stamp
    if url.partition("://")[0].lower() in ("s3", "s3a"):
        m = _S3_CONTENT_ETAG.fullmatch(stamp)
        if m is not None:
            return "s3-etag:" + m.group(1)
    return None


def object_identity(url: str, stamp: str | None, size: int) -> str:
    """What a sample's key holds of one object: ``"obj:<identity>:<size>"`` where the
    stamp is an identity of the bytes (:func:`byte_identity`: a copy elsewhere keeps its
    keys), else ``"obj:<url>:<stamp>:<size>"`` (this object, this version)."""
    ident = byte_identity(url, stamp)
    if ident is not None:
        return f"obj:{ident}:{size}"
    return f"obj:{url}:{stamp}:{size}"


class Remote:
    """Access to remote objects of one ``storage_options`` from this process.

    Args:
        storage_options: passed to fsspec's file system (credentials,
            ``client_kwargs={"endpoint_url": ...}``, ``anon``...), plus what makes the
            layer below make one attempt per call (:func:`~.options.backend_options`).
            Never printed whole: :func:`~.options.redact` hides credentials.
        retries: a :class:`RetryPolicy`, or the number of retries after the first try
            (the default policy otherwise).
        backoff: with an int ``retries``: seconds before the first retry (doubled each
            time, capped at the policy's ``max_backoff``).
        offline: ``"auto"``, ``True`` or ``False`` (see the module docstring).
        listing_dir: where the last listing of the objects is kept (``None``: nowhere,
            so ``offline`` has nothing to start from).
        sleep, clock: the sleep and monotonic clock functions (tests pass fake ones).

    Pickles as its options; each process opens its own file system and has its own
    circuit breaker. Thread-safe.
    """

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retries: int | RetryPolicy = 4,
        backoff: float | None = None,
        offline: Offline = False,
        listing_dir: str | os.PathLike[str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.storage_options = check_options(storage_options)
        if isinstance(retries, RetryPolicy):
            policy = retries
        else:
            policy = RetryPolicy.from_retries(retries)
            if backoff is not None:
                policy = RetryPolicy(attempts=policy.attempts, backoff=float(backoff))
        if offline not in ("auto", True, False):
            raise ConfigError(f"offline must be 'auto', True or False, got {offline!r}")
        self._policy = policy
        self.offline: Offline = offline
        self.listing_dir = os.fspath(listing_dir) if listing_dir is not None else None
        self.sleep = sleep
        self.clock = clock
        self._setup()

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._fs: dict[tuple[int, str], Any] = {}
        self._breaker_pid = -1
        self._breaker_obj: CircuitBreaker | None = None
        #: Whether the last :meth:`stamps` came from the kept listing, not the store.
        self.stale = False
        self._warned = False
        self._saved: dict[str, dict[str, Entry]] = {}  # the listings this process kept

    @property
    def policy(self) -> RetryPolicy:
        """The retry policy; setting another one starts this process's breaker afresh
        (the file system, its connections and credentials, are kept)."""
        return self._policy

    @policy.setter
    def policy(self, policy: RetryPolicy) -> None:
        if not isinstance(policy, RetryPolicy):
            raise ConfigError(f"policy must be a RetryPolicy, got {type(policy).__name__}")
        with self._lock:
            self._policy = policy
            self._breaker_obj = None

    @property
    def retries(self) -> int:
        """Retries after the first try (``policy.attempts - 1``)."""
        return self.policy.attempts - 1

    def __repr__(self) -> str:
        return f"Remote({redact(self.storage_options)!r}, offline={self.offline!r}, {self.policy})"

    def __getstate__(self) -> dict[str, Any]:
        return {
            "storage_options": self.storage_options,
            "_policy": self._policy,
            "offline": self.offline,
            "listing_dir": self.listing_dir,
            "sleep": self.sleep,
            "clock": self.clock,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    @property
    def breaker(self) -> CircuitBreaker:
        """This process's circuit breaker (a forked copy starts with a fresh one)."""
        with self._lock:
            if self._breaker_obj is None or self._breaker_pid != os.getpid():
                self._breaker_obj = CircuitBreaker(self.policy, clock=self.clock)
                self._breaker_pid = os.getpid()
            return self._breaker_obj

    @property
    def unreachable(self) -> bool:
        """Whether calls fail at once now (offline, or the breaker is open)."""
        return self.offline is True or self.breaker.is_open

    def new_epoch(self) -> None:
        """A new epoch begins (called by the revalidation): the epoch's retry budget is
        full again and an open breaker lets the next call through as a probe."""
        self.breaker.new_epoch()

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
                options = backend_options(
                    scheme,
                    self.storage_options,
                    connect_timeout=self.policy.connect_timeout,
                    read_timeout=self.policy.read_timeout,
                )
                # skip_instance_cache: a fork or another source with other options
                # never gets this instance (and its event loop) by accident.
                fs = quiet_retries(cls(skip_instance_cache=True, **options))
                self._fs[slot] = fs
        return fs, fs._strip_protocol(url)

    def attempt(self, url: str, op: Callable[[float | None], T]) -> T:
        """``op(timeout)`` under the retry policy and the circuit breaker (see
        :mod:`~mmcache.sources.blobs.retry`): ``timeout`` is what is left of the call's
        deadline (``None``: none). Raises :class:`RemoteError` when it gives up."""
        if self.offline is True:
            raise RemoteError(
                url, None, False, "offline=True: the store is never contacted", kind="offline"
            )
        breaker = self.breaker
        full = breaker.admit(url)  # False: a probe, one try
        policy = self.policy
        sleeps = policy.sleeps() if full else []
        deadline = policy.call_deadline
        if not full:  # a probe of a store that stopped answering: one short try
            deadline = min(deadline or policy.connect_timeout, policy.connect_timeout)
        t0 = self.clock()
        for number in range(len(sleeps) + 1):
            began = self.clock()
            left = None if deadline is None else max(deadline - (began - t0), 0.001)
            try:
                out = op(left)
            except Exception as exc:  # every error of every fsspec backend is classified
                err = classify(url, exc, self.storage_options)
                if err.no_response:
                    waited = left is not None and self.clock() - began >= 0.9 * left
                    breaker.unanswered(
                        err,
                        url=url,
                        connect=err.kind == "unreachable" or _connecting(exc),
                        waited_out=waited and err.kind == "timeout",
                    )
                else:
                    breaker.answered()
                if err.permanent or number == len(sleeps):
                    raise err from exc
                delay = sleeps[number]
                if not breaker.may_retry(self.clock() - t0, delay):
                    raise err from exc
                breaker.spent(self.clock() - began + delay)
                logger.debug("retrying %s in %.2f s after %s", url, delay, err)
                self.sleep(delay)
            except BaseException:
                breaker.release_probe()
                raise
            else:
                breaker.answered()
                return out
        raise AssertionError("unreachable")  # pragma: no cover

    def call(self, url: str, fn: Callable[[], T]) -> T:
        """``fn()`` under the retry policy (see :meth:`attempt`; ``fn`` has no timeout)."""
        return self.attempt(url, lambda _left: fn())

    def read(self, url: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object at ``url`` (one ranged GET, retried).

        The answer is read while it streams and never past ``end - start + 1`` bytes
        (:mod:`~mmcache.sources.blobs.ranged`): a server that ignores ``Range`` or sends
        more than asked is a permanent :class:`RemoteError` of kind ``"range-ignored"``
        once one byte too many came, never after its whole body was read. A GET that
        times out after the server answered is kind ``"timeout"`` with that HTTP status
        (one object's failure for the circuit breaker, as any timeout)."""
        fs, path = self.filesystem(url)
        want = end - start

        def get(left: float | None) -> bytes:
            answer = Answer()
            try:
                data = ranged_get(fs, path, start, end, answer=answer, timeout=left)
            except Exception as exc:
                if answer.status is None or not _timed_out(exc):
                    raise
                raise RemoteError(
                    url,
                    answer.status,
                    False,
                    f"the server answered HTTP {answer.status} but sent {answer.got} of the "
                    f"{want} bytes at {start} before the call's deadline "
                    f"({type(exc).__name__})",
                    kind="timeout",
                ) from exc
            if len(data) > want:
                declared = f", Content-Length {answer.length}" if answer.length else ""
                raise RemoteError(
                    url,
                    answer.status,
                    True,
                    f"the server ignored the Range request for bytes {start}-{end - 1} and "
                    f"sent more than those {want} bytes{declared} (reading stopped at the "
                    "first extra byte): serve it from a server that answers ranged GETs "
                    "(HTTP 206), or copy it locally",
                    kind="range-ignored",
                )
            if len(data) < want:
                raise RemoteError(
                    url,
                    answer.status,
                    False,
                    f"short read: {len(data)} of {want} bytes at {start}",
                    kind="short-read",
                )
            return data

        return self.attempt(url, get)

    def open(self, url: str, *, block_size: int = 8 << 20) -> Any:
        """A seekable binary file of ``url`` (read-ahead in ``block_size`` blocks)."""
        fs, path = self.filesystem(url)
        return self.call(url, lambda: fs.open(path, "rb", block_size=block_size))

    def glob(self, pattern: str) -> list[str]:
        """The URLs of the objects matching ``pattern`` (``*``, ``?``, ``[...]``; ``**``
        across folders), sorted, from a fresh listing under the retry policy: what a
        source given a remote glob (``s3://bucket/train-*.parquet``) reads."""
        fs, path = self.filesystem(pattern)

        def listing(_left: float | None) -> list[str]:
            fs.invalidate_cache()  # never a listing taken before an object was written
            found: list[str] = fs.glob(path)
            return found

        scheme = pattern.partition("://")[0]
        return [f"{scheme}://{p}" for p in sorted(self.attempt(pattern, listing))]

    def info(self, url: str) -> dict[str, Any]:
        """The object's fsspec ``info`` (size, ETag...), fresh (never from a listing cache)."""
        fs, path = self.filesystem(url)

        def fresh(left: float | None) -> dict[str, Any]:
            fs.invalidate_cache(path)
            out: dict[str, Any] = fs.info(path, **sync_timeout(fs, left))
            return out

        return self.attempt(url, fresh)

    def stamps(self, urls: Sequence[str]) -> dict[str, tuple[int, str | None] | RemoteError]:
        """``url -> (size, stamp)`` of many objects, batched: one fresh listing of each
        directory holding several of them, ``info`` for the rest; an object that cannot
        be found or read maps to its permanent :class:`RemoteError` (404, 403).

        When the store cannot be reached (or ``offline=True``) and ``offline`` allows it,
        the answer is the last listing kept in ``listing_dir`` (:attr:`stale` is set; one
        warning per process); else :class:`RemoteError`. An answer from the store is
        kept there for the next time."""
        listing = ListingFile(self.listing_dir, urls) if self.listing_dir is not None else None
        try:
            if self.offline is True:
                raise RemoteError(
                    urls[0] if urls else "?", None, False, "offline=True", kind="offline"
                )
            out = self._fresh_stamps(urls)
        except RemoteError as err:
            if err.permanent or self.offline is False:
                raise
            kept = listing.load() if listing is not None else None
            if kept is None or listing is None:
                raise
            return self._from_listing(urls, kept, err, listing)
        self.stale = False
        if listing is not None:
            entries: dict[str, Entry] = {
                url: got if not isinstance(got, RemoteError) else (-1, f"error:{got.status}")
                for url, got in out.items()
            }
            if self._saved.get(listing.path) != entries:  # written when it changed only
                listing.save(entries)
                self._saved[listing.path] = entries
        return out

    def _from_listing(
        self,
        urls: Sequence[str],
        kept: tuple[dict[str, Entry], float],
        err: RemoteError,
        listing: ListingFile,
    ) -> dict[str, tuple[int, str | None] | RemoteError]:
        entries, taken = kept
        missing = [u for u in urls if u not in entries]
        if missing:
            raise RemoteError(
                missing[0], None, False, f"{err.reason}; the kept listing does not name it"
            ) from err
        if not self._warned:
            self._warned = True
            age = max(time.time() - taken, 0.0)
            why = "offline=True" if self.offline is True else f"the store cannot be reached ({err})"
            logger.warning(
                "%s: using the listing of %d remote objects kept %.0f s ago in %s; it is not "
                "fresh: what the raw tier and the cache hold is served, objects changed "
                "since are seen only once the store answers",
                why,
                len(urls),
                age,
                listing.path,
            )
        self.stale = True
        out: dict[str, tuple[int, str | None] | RemoteError] = {}
        for url in urls:
            size, stamp = entries[url]
            if size < 0 and isinstance(stamp, str) and stamp.startswith("error:"):
                code = stamp.removeprefix("error:")
                status = int(code) if code.isdigit() else None
                out[url] = RemoteError(url, status, True, "(as of the kept listing)")
            else:
                out[url] = (size, stamp)
        return out

    def _fresh_stamps(self, urls: Sequence[str]) -> dict[str, tuple[int, str | None] | RemoteError]:
        by_dir: dict[str, list[str]] = {}
        for url in urls:
            by_dir.setdefault(url.rsplit("/", 1)[0], []).append(url)
        out: dict[str, tuple[int, str | None] | RemoteError] = {}
        for directory, members in by_dir.items():
            if len(members) > 1:
                fs, path = self.filesystem(directory)

                def listing(
                    left: float | None, fs: Any = fs, path: str = path
                ) -> list[dict[str, Any]]:
                    fs.invalidate_cache(path)
                    entries: list[dict[str, Any]] = fs.ls(
                        path, detail=True, **sync_timeout(fs, left)
                    )
                    return entries

                try:
                    entries = self.attempt(directory, listing)
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
