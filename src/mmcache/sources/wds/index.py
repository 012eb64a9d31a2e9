"""The member index of one tar shard: each member's name, data offset and size, found by
reading the tar headers only, and kept as a plain JSON file keyed by the shard's stamp.

:func:`scan` walks a shard's headers with :mod:`tarfile` under the bounds of
:mod:`~mmcache.sources.wds.tarwalk` (it seeks past every member's data, reading none of
it, except the small ``.json`` members whose ``width``/``height`` it records; a hostile
header is a :class:`~mmcache.sources.wds.tarwalk.DamagedShard`, never a hang or a large
allocation). A shard cut short (its last member truncated, or the end-of-archive blocks
missing) keeps the members whose data lies entirely inside the file and is marked
``truncated``. :func:`load_or_build` keeps the result in ``index_dir`` under a name
made of the shard's location and stamp (``size:mtime_ns`` of a local file, the ETag of
an object), so a changed shard is scanned again and an unchanged one never is. An index
file is plain data (JSON, no pickle), validated when it is read: one that does not match
its shard, or that is damaged, is rebuilt.

Thread/process safety: an index file is written to a temporary name and renamed, so
concurrent builders of one shard (two ranks) each write a complete file and readers see
one whole file or none.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from mmcache import keys
from mmcache.sources.wds.tarwalk import MAX_META, TarWalk

__all__ = ["INDEX_VERSION", "ShardIndex", "load_or_build", "scan"]

logger = logging.getLogger(__name__)

#: Bump when the index file's meaning changes: older files are rebuilt.
INDEX_VERSION = 1
_FORMAT = "mmcache.wds-index"
#: ``.json`` members larger than this are not read for their width and height.
_MAX_JSON = MAX_META


@dataclass(frozen=True)
class ShardIndex:
    """The members of one shard (tar order): names, data offsets, sizes; the ``width`` and
    ``height`` of each ``.json`` member that has them; whether the shard was cut short."""

    location: str
    stamp: str
    size: int
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dims: dict[str, tuple[int, int]]
    truncated: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": INDEX_VERSION,
            "location": self.location,
            "stamp": self.stamp,
            "size": self.size,
            "truncated": self.truncated,
            "members": [list(m) for m in zip(self.names, self.offsets, self.sizes, strict=True)],
            "dims": {k: list(v) for k, v in self.dims.items()},
        }

    @classmethod
    def from_json(cls, obj: Any, *, location: str, stamp: str) -> ShardIndex | None:
        """The index in ``obj`` if it is a valid index of this shard version, else ``None``."""
        if not isinstance(obj, dict) or obj.get("format") != _FORMAT:
            return None
        if obj.get("version") != INDEX_VERSION:
            return None
        if obj.get("location") != location or obj.get("stamp") != stamp:
            return None
        size, members, dims = obj.get("size"), obj.get("members"), obj.get("dims")
        if not isinstance(size, int) or not isinstance(members, list) or not isinstance(dims, dict):
            return None
        names, offsets, sizes = [], [], []
        for m in members:
            if not (
                isinstance(m, list)
                and len(m) == 3
                and isinstance(m[0], str)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in m[1:])
                and m[1] >= 0
                and m[2] >= 0
                and m[1] + m[2] <= size
            ):
                return None
            names.append(m[0])
            offsets.append(m[1])
            sizes.append(m[2])
        good_dims: dict[str, tuple[int, int]] = {}
        for name, wh in dims.items():
            if not (isinstance(wh, list) and len(wh) == 2 and all(isinstance(v, int) for v in wh)):
                return None
            good_dims[name] = (wh[0], wh[1])
        return cls(
            location,
            stamp,
            size,
            tuple(names),
            tuple(offsets),
            tuple(sizes),
            good_dims,
            bool(obj.get("truncated")),
        )


def _dims(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` of an img2dataset ``.json`` member, if it has both as ints."""
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict):
        return None
    w, h = obj.get("width"), obj.get("height")
    if isinstance(w, int) and isinstance(h, int) and not isinstance(w, bool | None):
        return w, h
    return None


def scan(
    fileobj: IO[bytes], *, location: str, stamp: str, size: int, json_exts: Sequence[str]
) -> ShardIndex:
    """The :class:`ShardIndex` of the tar in ``fileobj`` (``size`` bytes long).

    Raises :class:`tarfile.TarError` (or ``OSError``) when not even the first header can
    be read, :class:`~mmcache.sources.wds.tarwalk.DamagedShard` (a ``TarError``) on a
    header that cannot be trusted; a shard cut short later keeps its whole members and
    is ``truncated``.
    """
    names: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
    dims: dict[str, tuple[int, int]] = {}
    suffixes = tuple("." + e.lower() for e in json_exts)
    walk = TarWalk(fileobj, size=size, limit=_MAX_JSON)
    for member in walk:
        names.append(member.name)
        offsets.append(member.offset_data)
        sizes.append(member.size)
        if member.name.lower().endswith(suffixes) and member.size <= _MAX_JSON:
            wh = _dims(walk.read(member))
            if wh is not None:
                dims[member.name] = wh
    if walk.truncation is not None:
        logger.warning("shard %s is truncated: %s", location, walk.truncation)
    truncated = walk.truncated
    return ShardIndex(
        location, stamp, size, tuple(names), tuple(offsets), tuple(sizes), dims, truncated
    )


def index_path(index_dir: str, location: str, stamp: str) -> str:
    """Where the index of version ``stamp`` of the shard at ``location`` is kept."""
    name = keys.digest("mmcache.wds-index", INDEX_VERSION, location, stamp).hex()
    return os.path.join(index_dir, f"{name}.json")


def load_or_build(
    *,
    location: str,
    stamp: str,
    size: int,
    opener: Callable[[], IO[bytes]],
    index_dir: str | None,
    json_exts: Sequence[str],
) -> ShardIndex:
    """The shard's index from ``index_dir`` if a valid one is there, else scanned (with
    ``opener()``) and written there. ``index_dir=None`` scans without keeping it."""
    path = None if index_dir is None else index_path(index_dir, location, stamp)
    if path is not None:
        try:
            with open(path, encoding="utf-8") as fh:
                found = ShardIndex.from_json(json.load(fh), location=location, stamp=stamp)
        except FileNotFoundError:
            found = None
        except (OSError, ValueError) as exc:
            logger.warning("rebuilding the index of %s: %s unreadable (%s)", location, path, exc)
            found = None
        if found is not None:
            return found
    with opener() as fh:
        index = scan(fh, location=location, stamp=stamp, size=size, json_exts=json_exts)
    if path is not None and index_dir is not None:
        try:
            os.makedirs(index_dir, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=index_dir, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    json.dump(index.to_json(), out, separators=(",", ":"))
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:  # an index that cannot be kept is scanned again next time
            logger.warning("cannot keep the index of %s in %s: %s", location, index_dir, exc)
    return index
