"""Where WebDataset member indexes live, and their removal by ``mmcache gc``.

A member index (:mod:`~mmcache.sources.wds.index`) saves reading every tar header
again at each open. It belongs with the data it describes, never in a folder of
the home directory that no cleanup of the cache knows about (``$XDG_CACHE_HOME``
was the default before, and a user deleting the cache root left it behind):

- ``index_dir=`` given: there (``cache.root / "wds-index"``, :data:`INDEX_FOLDER`,
  is the folder ``mmcache gc --cache ROOT`` sweeps);
- a remote shard read through a raw tier: :data:`INDEX_FOLDER` beside the raw
  tier's folder (``cache.root / "raw"`` gives ``cache.root / "wds-index"``);
- a local shard: a per-user folder beside the shard, ``.mmcache-index-u<uid>``,
  when that directory is writable. Per user and mode 0700 because a shard
  folder is often shared by a team: an index another user could write would
  steer our reads to other offsets, so a folder that is not ours (owner, a
  symlink, group or other bits) is never used;
- otherwise nothing is kept and the shard is scanned at each open.

:func:`sweep_indexes` is the ``gc`` half: an index of a local shard that is gone
or changed since (its ctime is after the index was written: a rewrite can
restore the mtime, never the ctime) is removed, and so are leftover temporary
files and the JSON indexes of earlier versions (never read again). Safe while
other processes read or write indexes (each write is a rename of a complete
file; a reader that loses a file rebuilds it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import time

from mmcache.sources.blobs.objects import is_remote
from mmcache.sources.wds.tablefile import SUFFIX, location_of

__all__ = ["INDEX_FOLDER", "index_home", "state_home", "sweep_indexes"]

logger = logging.getLogger(__name__)

#: The folder of member indexes under a cache root.
INDEX_FOLDER = "wds-index"

#: A temporary file this old is a crashed writer's leftover, never one being written.
_STALE_TMP_S = 3600.0


def _own_private_dir(path: str) -> bool:
    """Whether ``path`` is a real directory of this user that nobody else can write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _beside(location: str) -> str | None:
    """The per-user index folder beside the local shard ``location``, made if possible."""
    parent = os.path.dirname(os.path.abspath(location))
    path = os.path.join(parent, f".mmcache-index-u{os.geteuid()}")
    if _own_private_dir(path):
        return path
    if os.path.lexists(path) or not os.access(parent, os.W_OK | os.X_OK):
        return None  # not ours (or not writable): scan at each open
    with contextlib.suppress(OSError):
        os.mkdir(path, 0o700)
    return path if _own_private_dir(path) else None


def index_home(location: str, *, raw_path: str | None) -> str | None:
    """Where the index of the shard at ``location`` is kept by default (see the module
    docstring), or None to keep none. May create the per-user folder beside a local
    shard. Process-safe."""
    if is_remote(location):
        return None if raw_path is None else os.path.join(os.path.dirname(raw_path), INDEX_FOLDER)
    return _beside(location)


def state_home(raw_path: str | None) -> str | None:
    """The default folder of a source's shared stamp file: the raw tier's parent (the
    cache root), or None (the caller's fallback)."""
    return None if raw_path is None else os.path.dirname(raw_path)


def _superseded(path: str, location: str) -> bool:
    """Whether the index file ``path`` of the shard at ``location`` can go."""
    if is_remote(location):
        return False  # checking costs a request; its next open replaces it if changed
    try:
        shard = os.stat(location)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return shard.st_ctime_ns > os.stat(path).st_mtime_ns


def sweep_indexes(index_dir: str, *, now: float | None = None) -> list[str]:
    """Remove from ``index_dir`` the indexes of local shards that are gone or changed,
    unreadable index files and stale temporary files; returns the paths removed.
    A missing folder is nothing to do. Process-safe (see the module docstring)."""
    removed: list[str] = []
    try:
        names = sorted(os.listdir(index_dir))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    t = time.time() if now is None else now
    for name in names:
        path = os.path.join(index_dir, name)
        try:
            if name.startswith(".tmp-"):
                drop = t - os.lstat(path).st_mtime > _STALE_TMP_S
            elif name.endswith(SUFFIX):
                location = location_of(path)
                drop = location is None or _superseded(path, location)
            elif name.endswith(".json"):  # a JSON index of version 1: replaced by a table
                with open(path, encoding="utf-8") as fh:
                    drop = json.load(fh).get("format") == "mmcache.wds-index"
            else:
                continue
        except FileNotFoundError:
            continue
        except (OSError, ValueError, AttributeError):
            drop = True  # unreadable: the next open rebuilds it anyway
        if drop:
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
                os.unlink(path)
                removed.append(path)
                logger.info("removed WebDataset member index %s", path)
    return removed
