"""Node-wide cleanup of memory stores, without attaching to them: orphans and removal.

A store outlives the processes that made it (that is the point of a node-shared
tier), so someone must remove the ones nobody will use again: :func:`reclaim_orphans`
(``mmcache gc``, ``Cache.gc``) judges each store from its files alone, under its
lock taken without waiting; :func:`unlink_store` removes one store whether or not
it is in use.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import logging
import os

from mmcache.errors import CacheError
from mmcache.rootfiles import read_root_id
from mmcache.stores.memory import shm
from mmcache.stores.memory.access import Access, UntrustedFileError
from mmcache.stores.memory.index import index_paths, index_problem
from mmcache.stores.memory.layout import (
    FLAG_TEMPORARY,
    H_CAPACITY,
    H_FLAGS,
    H_INDEX_GEN,
    H_MAGIC,
    H_META_SIZE,
    H_OWNER_ID,
    H_OWNER_LEN,
    H_PID_NAMESPACE,
    H_STATE,
    MAGIC,
    Layout,
    StoreState,
    data_paths,
    lock_path,
    meta_path,
    read_header,
    remove_file,
)
from mmcache.stores.memory.procs import any_alive
from mmcache.stores.memory.session import OPEN_TIMEOUT
from mmcache.stores.memory.shm import (
    EXCLUSIVE,
    SHM_PREFIX,
    NodeLock,
    Segment,
    check_store_name,
    pid_namespace,
)
from mmcache.stores.memory.slabs import data_problem

__all__ = ["reclaim_orphans", "store_owner", "unlink_store"]

log = logging.getLogger(__name__)


def _store_names(directory: str, pattern: str) -> dict[str, list[str]]:
    """Store names found in ``directory`` (matching the glob ``pattern``) and their files."""
    names: dict[str, list[str]] = {}
    for path in glob.glob(os.path.join(glob.escape(directory), SHM_PREFIX + "*")):
        base = os.path.basename(path)[len(SHM_PREFIX) :]
        for suffix in (".lock", "-meta"):
            if base.endswith(suffix):
                name = base[: -len(suffix)]
                break
        else:
            if len(base) > 5 and base[-5:-3] in ("-d", "-i") and base[-3:].isdigit():
                name = base[:-5]
            else:
                continue
        if fnmatch.fnmatchcase(name, pattern):
            names.setdefault(name, []).append(path)
    return names


def _scan_access(group: int | None) -> Access:
    return Access(0o600 if group is None else 0o660, group)


def _existing_directory(access: Access) -> str | None:
    """The store directory of ``access`` if it exists (never made here), else None.

    A directory another user could control raises :class:`UntrustedFileError`.
    """
    try:
        return access.ensure_directory(shm.SHM_DIR, create=False)
    except UntrustedFileError:
        raise
    except CacheError:
        return None


def _owner_gone(owner: str, owner_id: int) -> str | None:
    """Why the cache root ``owner`` (of identity ``owner_id``) no longer wants its store,
    or None: the path is gone, or holds a root of another identity now (removed and made
    again: a new root, whose memory tier has another name), or a root that got an
    identity since the store was made without one (made before roots had one: that root
    now names its memory tier after it). A root whose identity cannot be read
    (permissions: another member's private file) keeps its store."""
    if not os.path.exists(owner):
        return f"owner path {owner} no longer exists"
    try:
        now = read_root_id(owner) or 0
    except FileNotFoundError:
        return f"owner path {owner} no longer exists"
    except (OSError, CacheError):
        return None  # not ours to judge
    if now == owner_id:
        return None
    if not owner_id:
        return f"made before cache root {owner} had an identity (it is {now:016x} now)"
    return (
        f"owner path {owner} holds another cache root now (identity {now:016x}, the "
        f"store's {owner_id:016x}): the root was removed and made again"
    )


def _orphan_reason(directory: str, name: str, access: Access) -> str | None:
    """Why the store ``name`` should go, or None to keep it. Caller holds its lock (EX)."""
    try:
        seg = Segment.open(meta_path(directory, name), access=access)
    except FileNotFoundError:
        return "no meta segment (creation never finished)"
    except UntrustedFileError:
        return None  # not ours to judge, nor to remove
    except CacheError:
        return "truncated meta segment"
    except OSError:
        return None  # not ours to judge (permissions)
    try:
        h = read_header(seg)
        if int(h[H_MAGIC]) != MAGIC or int(h[H_META_SIZE]) != seg.size:
            return "not a valid store (bad magic or size)"
        if int(h[H_STATE]) != StoreState.READY:
            return "half-initialised by a dead creator"
        if int(h[H_PID_NAMESPACE]) != pid_namespace():
            return None  # its processes' liveness cannot be judged from here
        layout = Layout.of_header(h)
        if layout.size != seg.size:
            return "not a valid store (layout size)"
        arrays = layout.arrays(seg.buf)
        live = any_alive(arrays["procs"])
        owner_len = int(h[H_OWNER_LEN])
        owner = (
            arrays["owner"][:owner_len].tobytes().decode(errors="replace") if owner_len else None
        )
        temporary = bool(int(h[H_FLAGS]) & FLAG_TEMPORARY)
        reason = None
        if not live:
            try:
                reason = data_problem(
                    directory, name, access, int(h[H_CAPACITY]), arrays["classes"]
                ) or index_problem(directory, name, access, int(h[H_INDEX_GEN]))
            except UntrustedFileError:
                return None
            if reason is not None:
                pass  # a damaged store: every later open would fail on it
            elif temporary:
                reason = "temporary and no live process attached"
            elif owner is not None:
                reason = _owner_gone(owner, int(h[H_OWNER_ID]))
        if reason is not None:
            h[H_STATE] = StoreState.UNLINKED
        del h, arrays
        return reason
    finally:
        seg.close()


def store_owner(name: str, *, group: int | None = None) -> str | None:
    """The cache root recorded in the store ``name`` (its ``owner_path``), or None
    when it has none, cannot be read (missing, damaged, half-made) or is not ours.

    Reads the meta segment's header only: no lock is taken and nothing is
    attached or changed, so it is safe on a store other processes use (the
    owner path is written once, at creation). Process-safe.
    """
    check_store_name(name)
    access = _scan_access(group)
    try:
        directory = _existing_directory(access)
        if directory is None:
            return None
        seg = Segment.open(meta_path(directory, name), access=access)
    except (CacheError, OSError):
        return None
    raw = b""
    try:
        h = read_header(seg)
        if int(h[H_MAGIC]) == MAGIC and int(h[H_META_SIZE]) == seg.size:
            with contextlib.suppress(ValueError, CacheError):  # a half-written header
                layout = Layout.of_header(h)
                if layout.size == seg.size:
                    arrays = layout.arrays(seg.buf)
                    raw = arrays["owner"][: int(h[H_OWNER_LEN])].tobytes()
                    del arrays
        del h
    finally:
        seg.close()
    return raw.decode(errors="replace") or None


def reclaim_orphans(
    pattern: str = "*", *, group: int | None = None, owner: str | None = None
) -> list[str]:
    """Remove memory stores of this user (or of ``group``) that nobody will use again;
    return the paths removed.

    A store goes when no live process is attached to it and it is temporary,
    or its ``owner_path`` (the cache root) no longer exists or holds another root
    now (another identity: removed and made again), or one of its data
    segments is missing or truncated, or it was left half-initialised by a
    creator that died; also leftover files of a store without a lock file.
    Stores whose lock is held right now are skipped, and so are files another
    user could control. ``pattern`` is a glob on store names (``Cache.gc``
    passes its own store's name); ``owner``: only the stores whose recorded owner
    path is that one (the stores of one cache root, whatever their names: those of
    its earlier incarnations). Process-safe.
    """
    removed: list[str] = []
    access = _scan_access(group)
    directory = _existing_directory(access)
    if directory is None:
        return removed  # no directory: no store
    for name, paths in sorted(_store_names(directory, pattern).items()):
        if owner is not None and store_owner(name, group=group) != owner:
            continue  # another root's (read without the lock: judged again under it)
        if not os.path.exists(lock_path(directory, name)):
            for path in paths:
                remove_file(path, removed)
            continue
        try:
            lock = NodeLock(lock_path(directory, name), create=False, access=access)
        except CacheError:
            continue
        try:
            if not lock.try_exclusive():
                continue
            try:
                if lock.unlinked():
                    continue
                reason = _orphan_reason(directory, name, access)
                if reason is not None:
                    log.info("removing orphaned memory store %s: %s", name, reason)
                    for path in [
                        *data_paths(directory, name),
                        *index_paths(directory, name),
                        meta_path(directory, name),
                        lock_path(directory, name),
                    ]:
                        remove_file(path, removed)
            finally:
                lock.release()
        finally:
            lock.close()
    return removed


def unlink_store(
    name: str, *, timeout: float = OPEN_TIMEOUT, group: int | None = None
) -> list[str]:
    """Remove the store ``name`` (all its files), whether or not it is in use.

    Waits for the lock (at most ``timeout`` seconds) so no critical section is
    cut in half; processes still attached get ``CacheError`` on their next
    operation. Returns the paths removed. Process-safe.
    """
    check_store_name(name)
    removed: list[str] = []
    access = _scan_access(group)
    directory = _existing_directory(access)
    if directory is None:
        return removed

    def files() -> list[str]:
        return [
            *data_paths(directory, name),
            *index_paths(directory, name),
            meta_path(directory, name),
        ]

    try:
        lock = NodeLock(lock_path(directory, name), create=False, access=access)
    except UntrustedFileError:
        raise
    except CacheError:
        for path in files():
            remove_file(path, removed)
        return removed
    try:
        with lock.hold(EXCLUSIVE, timeout=timeout):
            with contextlib.suppress(FileNotFoundError, CacheError):
                seg = Segment.open(meta_path(directory, name), access=access)
                try:
                    h = read_header(seg)
                    if int(h[H_MAGIC]) == MAGIC:
                        h[H_STATE] = StoreState.UNLINKED
                    del h
                finally:
                    seg.close()
            for path in [*files(), lock_path(directory, name)]:
                remove_file(path, removed)
    finally:
        lock.close()
    return removed
