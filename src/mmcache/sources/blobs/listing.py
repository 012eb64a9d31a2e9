"""The last listing of a source's objects, kept on local disk, so that a job restarted
while the store cannot be reached starts from it (``offline="auto"`` or ``True``).

Each time :meth:`~mmcache.sources.blobs.objects.Remote.stamps` gets an answer for a set of
objects it records ``url -> (size, stamp)`` (or the permanent error's status) in
``<dir>/listing-<digest of the URLs>.json``: the source's state folder (under the cache
root, beside the raw tier) or its WebDataset index folder. A source opened on that
root while the store is down finds the stamps its raw tier and shard indexes are keyed
by, so every sample they hold is served, bitwise the same; nothing claims the listing
is fresh (the caller warns, and revalidates once the store answers).

Files are written to a temporary name in the folder and renamed (a reader sees a whole
file or none); a file owned by another user, not a regular file, larger than
:data:`MAX_BYTES` or of another shape is ignored with a warning (never trusted: it
only decides which *keys* are looked up, and keys hold the stamps). Process-safe.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Mapping, Sequence

from mmcache import keys
from mmcache.rootfiles import replace_file

__all__ = ["MAX_BYTES", "Entry", "ListingFile"]

logger = logging.getLogger(__name__)

#: The largest listing file read back (a million objects with long URLs fit).
MAX_BYTES = 512 << 20
_VERSION = 1

#: ``(size, stamp)`` of an object, or ``(-1, "error:<status>")`` for a permanent error.
Entry = tuple[int, str | None]


class ListingFile:
    """The listing of ``urls`` in folder ``directory`` (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str], urls: Sequence[str]) -> None:
        self.directory = os.fspath(directory)
        name = keys.digest("mmcache.remote-listing", _VERSION, *sorted(urls)).hex()
        self.path = os.path.join(self.directory, f"listing-{name}.json")

    def save(self, entries: Mapping[str, Entry]) -> None:
        """Record ``entries`` (a failure to write is a warning: the run goes on)."""
        payload = {
            "version": _VERSION,
            "time": time.time(),
            "entries": {url: [int(size), stamp] for url, (size, stamp) in entries.items()},
        }
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            text = json.dumps(payload, separators=(",", ":"))
            replace_file(self.path, text.encode("utf-8"), 0o600)
        except OSError as exc:
            logger.warning("cannot keep the listing of remote objects in %s: %s", self.path, exc)

    def load(self) -> tuple[dict[str, Entry], float] | None:
        """``(entries, unix time it was taken)``, or ``None`` when none usable is kept."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                logger.warning("ignoring %s: not a regular file of this user", self.path)
                return None
            if st.st_size > MAX_BYTES:
                logger.warning("ignoring %s: %d bytes (over %d)", self.path, st.st_size, MAX_BYTES)
                return None
            with os.fdopen(os.dup(fd), encoding="utf-8") as fh:
                payload = json.load(fh)
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the listing %s: %s", self.path, exc)
            return None
        finally:
            os.close(fd)
        return _parse(payload, self.path)


def _parse(payload: object, path: str) -> tuple[dict[str, Entry], float] | None:
    if not isinstance(payload, dict) or payload.get("version") != _VERSION:
        logger.warning("ignoring the listing %s: another version", path)
        return None
    entries, taken = payload.get("entries"), payload.get("time")
    if not isinstance(entries, dict) or not isinstance(taken, (int, float)):
        logger.warning("ignoring the listing %s: malformed", path)
        return None
    out: dict[str, Entry] = {}
    for url, entry in entries.items():
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or not isinstance(entry[0], int)
            or not (entry[1] is None or isinstance(entry[1], str))
        ):
            logger.warning("ignoring the listing %s: malformed entry of %s", path, url)
            return None
        out[url] = (entry[0], entry[1])
    return out, float(taken)
