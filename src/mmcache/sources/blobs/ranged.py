"""One ranged GET that never takes more bytes than it asked for (H5).

fsspec's ``cat_file`` reads the whole body of the answer before it returns, so a server
that ignores ``Range`` (HTTP 200 with the whole object) or lies about a size (its HEAD
says 643 bytes, its GET streams 600 MB) had its whole answer read into memory before
:meth:`~mmcache.sources.blobs.objects.Remote.read` could count it: 1.2 GB of peak memory for
one 643-byte sample. Here the answer's body is read in chunks, never more than the
``end - start`` bytes asked for plus one: that one extra byte proves the server sent
more, and the connection is closed at once.

- ``s3://`` (s3fs) and ``http(s)://`` (fsspec's HTTP file system) are streamed:
  :func:`ranged_get` sends the GET itself, with the file system's own session and
  options (s3fs's ``_call_s3`` with the range, as its ``cat_file`` does; the aiohttp
  session and ``Range`` header fsspec's HTTP one sends), and reads the body stream;
- any other file system (``gs://``: gcsfs reads each answer whole inside its request
  method and offers no stream of a ranged GET) is read with ``cat_file`` and checked
  after, as before. Those are object stores whose servers honour ``Range``.

What came of the GET so far (its HTTP status, the bytes received, the length the server
declared) is kept in an :class:`Answer` as the body arrives, so a GET that times out
after the server answered can say so (its status and how many bytes came).

The s3fs path uses two of s3fs's own members (``_call_s3``, ``req_kw``), pinned with
fsspec by the ``s3`` extra. Thread-safe: the coroutine runs on the file system's event
loop; its :class:`Answer` is read by the caller only after the call returned or failed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Answer", "ranged_get", "sync_timeout"]

#: Bytes asked of the body stream per read (aiohttp's own buffer is 64 KiB).
_CHUNK = 64 << 10


@dataclass
class Answer:
    """What one GET got so far: filled while it streams (see the module docstring)."""

    #: The HTTP status of the answer (``None``: none came yet).
    status: int | None = None
    #: Body bytes received.
    got: int = 0
    #: The body length the server declared (its ``Content-Length``), if any.
    length: int | None = None


async def _take(read: Callable[[int], Awaitable[bytes]], want: int, answer: Answer) -> bytes:
    """Up to ``want + 1`` bytes of a body (``read(n)``: at most ``n`` bytes, ``b""`` at
    its end): the body whole when it has at most ``want``, else ``want + 1`` bytes."""
    parts: list[bytes] = []
    while answer.got <= want:
        chunk = await read(min(_CHUNK, want + 1 - answer.got))
        if not chunk:
            break
        parts.append(chunk)
        answer.got += len(chunk)
    return b"".join(parts)


async def _http_get(fs: Any, url: str, start: int, end: int, answer: Answer) -> bytes:
    """The ranged GET of fsspec's HTTP file system (its ``_cat_file``), body streamed."""
    session = await fs.set_session()
    kw = dict(fs.kwargs)
    headers = dict(kw.pop("headers", None) or {})
    headers["Range"] = f"bytes={start}-{end - 1}"
    async with session.get(fs.encode_url(url), headers=headers, **kw) as r:
        if r.status == 404:
            raise FileNotFoundError(url)
        r.raise_for_status()  # aiohttp's ClientResponseError keeps the status
        answer.status, answer.length = r.status, r.content_length
        data = await _take(r.content.read, end - start, answer)
        if answer.got > end - start:
            r.close()  # the rest of the body is never read: drop the connection
        return data


async def _s3_get(fs: Any, path: str, start: int, end: int, answer: Answer) -> bytes:
    """s3fs's ranged ``get_object`` (its ``_cat_file``), body streamed."""
    bucket, key, version = fs.split_path(path)
    resp = await fs._call_s3(
        "get_object",
        Bucket=bucket,
        Key=key,
        Range=f"bytes={start}-{end - 1}",
        **({"VersionId": version} if version else {}),
        **fs.req_kw,
    )
    answer.status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
    answer.length = resp.get("ContentLength")
    body = resp["Body"]
    try:
        return await _take(body.read, end - start, answer)
    finally:
        body.close()  # after a whole body a no-op; after an extra byte it drops the rest


#: The streamed GET of each file system whose answers are streamed, by its module.
_STREAMED: dict[str, Callable[[Any, str, int, int, Answer], Awaitable[bytes]]] = {
    "s3fs.core": _s3_get,
    "fsspec.implementations.http": _http_get,
}


def sync_timeout(fs: Any, left: float | None) -> dict[str, Any]:
    """fsspec's ``timeout=`` for a sync call of an async file system (it cancels the
    coroutine when the call's deadline passes); nothing for others."""
    from fsspec.asyn import AsyncFileSystem

    return {"timeout": left} if left is not None and isinstance(fs, AsyncFileSystem) else {}


def ranged_get(
    fs: Any, path: str, start: int, end: int, *, answer: Answer, timeout: float | None
) -> bytes:
    """Bytes ``[start, end)`` of ``path`` on ``fs``, one GET: at most ``end - start + 1``
    bytes (more than ``end - start`` means the server sent more than asked; the caller
    refuses them), fewer when the body was shorter. ``timeout``: seconds for the whole
    call (``None``: none). Raises what the file system raises (the caller classifies it);
    ``answer`` says what came before a failure."""
    get = _STREAMED.get(type(fs).__module__)
    if get is None:
        data = bytes(fs.cat_file(path, start=start, end=end, **sync_timeout(fs, timeout)))
        answer.got = len(data)
        return data
    from fsspec.asyn import sync

    out: bytes = sync(fs.loop, get, fs, path, start, end, answer, timeout=timeout)
    return out
