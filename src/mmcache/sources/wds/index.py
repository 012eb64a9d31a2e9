"""The member index of one tar shard (each member's name, data offset and size, found by
reading the tar headers only), and where a source keeps its samples' table of it.

:func:`scan` reads a shard's headers: at C speed when the shard is clean
(:mod:`~mmcache.sources.wds.headers`: headers read in large windows, checked at once),
else with :mod:`tarfile` under the bounds of :mod:`~mmcache.sources.blobs.tarwalk`, which
says what is wrong (a hostile header is a
:class:`~mmcache.sources.blobs.tarwalk.DamagedShard`, never a hang or a large allocation;
a shard cut short keeps the members whose data lies entirely inside the file and is
marked ``truncated``). Either way it reads the small ``.json`` members, whose ``width``
and ``height`` it records, and no other member's data.

:func:`load_or_build` gives the shard's samples, grouped by key
(:class:`~mmcache.sources.wds.table.ShardTable`), from the member index file kept in
``index_dir`` under a name made of the shard's location and stamp (``size:mtime_ns``...
of a local file, the ETag of an object) and the source's extensions
(:mod:`~mmcache.sources.wds.tablefile`: binary arrays, read and checked at C speed), or
scans the shard and writes that file: a changed shard is scanned again and an
unchanged one never is. A damaged file is refused, naming it, and rebuilt.

Thread/process safety: an index file is written to a temporary name and renamed, so
concurrent builders of one shard (two ranks) each write a complete file and readers see
one whole file or none.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from typing import IO

from mmcache import keys
from mmcache.sources.blobs.tarwalk import MAX_META, TarWalk
from mmcache.sources.wds import tablefile
from mmcache.sources.wds.headers import quick_walk
from mmcache.sources.wds.table import Exts, ShardIndex, ShardTable

__all__ = ["INDEX_VERSION", "ShardIndex", "index_path", "load_or_build", "scan"]

logger = logging.getLogger(__name__)

#: Bump when the index file's meaning changes: older files are rebuilt.
INDEX_VERSION = tablefile.VERSION
#: ``.json`` members larger than this are not read for their width and height.
_MAX_JSON = MAX_META


_INT64 = range(-(1 << 63), 1 << 63)


#: ``json.loads``' own decoder, called without its wrapper (see :func:`_loads`).
_DECODER = json.JSONDecoder()
_JSON_SPACE = " \t\n\r"  # what json.loads allows around a document


def _loads(data: bytes) -> object:
    """``json.loads(data)``, at a quarter of its cost for the usual ``.json`` member.

    ``json.loads`` of bytes first guesses the encoding in Python, then wraps the C
    scanner in two more Python calls: ~2.5 us a member, as much as the rest of a
    sample's first open. A document that starts with ``{`` and whose second byte is not
    NUL is UTF-8 to that guess (no byte-order mark, not UTF-16/32), so it is decoded
    here and handed to the scanner directly; the same checks follow (only JSON
    whitespace after the document). Anything else goes to ``json.loads`` itself."""
    if len(data) < 2 or data[0] != 0x7B or data[1] == 0:
        return json.loads(data)
    text = data.decode("utf-8", "surrogatepass")
    try:
        obj, end = _DECODER.scan_once(text, 0)  # type: ignore[attr-defined]  # the C scanner
    except StopIteration as stop:
        raise json.JSONDecodeError("Expecting value", text, stop.value) from None
    if text[end:].strip(_JSON_SPACE):
        raise json.JSONDecodeError("Extra data", text, end)
    return obj


def _all_dims(data: dict[int, bytes]) -> dict[int, tuple[int, int]]:
    """``(width, height)`` of each img2dataset ``.json`` member (its bytes by member
    number) that has both as ints, kept as int64: a member that is not JSON, too deep
    to parse, or whose numbers do not fit leaves its sample's size unknown. One loop,
    no call per member (it runs for a member in three at a first open)."""
    out: dict[int, tuple[int, int]] = {}
    loads, span = _loads, _INT64
    for i, raw in data.items():
        try:
            obj = loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            continue
        if type(obj) is dict:  # json gives a dict, never a subclass
            w, h = obj.get("width"), obj.get("height")
            if (
                isinstance(w, int)
                and isinstance(h, int)
                and type(w) is not bool
                and w in span  # kept as int64
                and h in span
            ):
                out[i] = (w, h)
    return out


def scan(
    fileobj: IO[bytes], *, location: str, stamp: str, size: int, json_exts: Sequence[str]
) -> ShardIndex:
    """The :class:`ShardIndex` of the tar in ``fileobj`` (``size`` bytes long).

    Raises :class:`tarfile.TarError` (or ``OSError``) when not even the first header can
    be read, :class:`~mmcache.sources.blobs.tarwalk.DamagedShard` (a ``TarError``) on a
    header that cannot be trusted; a shard cut short later keeps its whole members and
    is ``truncated``.
    """
    suffixes = tuple("." + e.lower() for e in json_exts)
    walked = quick_walk(fileobj, size=size, suffixes=suffixes, limit=_MAX_JSON)
    if walked is not None:  # a clean shard: its headers read at C speed
        dims = _all_dims(walked.data)
        return ShardIndex(
            location, stamp, size, walked.names, walked.offsets, walked.sizes, dims, False
        )
    names: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
    small: dict[int, bytes] = {}
    fileobj.seek(0)
    walk = TarWalk(fileobj, size=size, limit=_MAX_JSON)
    for member in walk:
        names.append(member.name)
        offsets.append(member.offset_data)
        sizes.append(member.size)
        if member.name.lower().endswith(suffixes) and member.size <= _MAX_JSON:
            small[len(names) - 1] = walk.read(member)
    if walk.truncation is not None:
        logger.warning("shard %s is truncated: %s", location, walk.truncation)
    return ShardIndex(
        location, stamp, size, names, offsets, sizes, _all_dims(small), walk.truncated
    )


def index_path(index_dir: str, location: str, stamp: str, exts: Exts) -> str:
    """Where the table of version ``stamp`` of the shard at ``location``, grouped for the
    extensions ``exts``, is kept."""
    name = keys.digest("mmcache.wds-index", INDEX_VERSION, location, stamp, repr(exts)).hex()
    return os.path.join(index_dir, f"{name}{tablefile.SUFFIX}")


def load_or_build(
    *,
    location: str,
    stamp: str,
    size: int,
    opener: Callable[[], IO[bytes]],
    index_dir: str | None,
    exts: Exts,
) -> ShardTable:
    """The shard's samples from its member index file in ``index_dir`` if a valid one is
    there, else scanned (with ``opener()``), grouped and written there.
    ``index_dir=None`` scans without keeping it."""
    path = None if index_dir is None else index_path(index_dir, location, stamp, exts)
    if path is not None:
        found = tablefile.read(path, location=location, stamp=stamp, exts=exts)
        if found is not None:
            return found
    with opener() as fh:
        index = scan(fh, location=location, stamp=stamp, size=size, json_exts=exts[2])
    table = ShardTable.group(index, exts)
    if path is not None and index_dir is not None:
        try:
            os.makedirs(index_dir, exist_ok=True)
            tablefile.write(path, table)
        except OSError as exc:  # an index that cannot be kept is scanned again next time
            logger.warning("cannot keep the index of %s in %s: %s", location, index_dir, exc)
    return table
