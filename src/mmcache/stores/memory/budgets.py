"""What the memory stores of a node have promised themselves in ``/dev/shm``, for sizing.

A store reserves its pages as it fills (``layout.py``), so ``/dev/shm``'s free space
says nothing of the budgets already given: three jobs that size ``memory="auto"``
from the free space alone each take half of it, and together overfill it. So
:func:`shm_claims` reads each live store's declared budget (``capacity``) and what it
holds already, without attaching to it (no lock, nothing written: the header's
capacity is written once, at creation), and :func:`sizing_turn` lets one process of
this user at a time size its budget and create its store, so that jobs started
together see each other's budgets.

Process-safe: reads files only, and an ``flock`` the kernel drops when its holder dies.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from mmcache.errors import CacheError
from mmcache.stores.memory import shm
from mmcache.stores.memory.access import Access
from mmcache.stores.memory.layout import (
    H_CAPACITY,
    H_MAGIC,
    H_META_SIZE,
    H_PID_NAMESPACE,
    H_STATE,
    HEADER_WORDS,
    MAGIC,
    Layout,
    StoreState,
)
from mmcache.stores.memory.procs import any_alive
from mmcache.stores.memory.shm import EXCLUSIVE, SHM_PREFIX, LockTimeout, NodeLock, pid_namespace

__all__ = ["ShmClaims", "shm_claims", "sizing_turn"]

log = logging.getLogger(__name__)

#: The lock file of :func:`sizing_turn` in a store directory (not ``mmcache-*``: no store).
SIZING_LOCK = "sizing.lock"
#: Seconds a process waits for its turn to size before it sizes without it.
SIZING_WAIT_S = 10.0
_META_SUFFIX = "-meta"


@dataclass(frozen=True)
class ShmClaims:
    """Bytes of ``/dev/shm`` the memory stores of a node claim.

    ``directory``: where the stores live (``/dev/shm``); ``promised``: what the live
    stores other than the one asked about may still take (their budgets less what
    they hold); ``own``: what that store holds already (a reopened cache: its own
    pages are room for its budget).
    """

    directory: str
    promised: int = 0
    own: int = 0


def shm_claims(name: str | None = None) -> ShmClaims:
    """The claims on ``/dev/shm`` of every store this process can read (this user's,
    its groups', any other readable), ``name`` (a store's name) set apart.

    A store counts while a live process is attached to it (one of another pid
    namespace counts as live: its liveness cannot be judged from here); a store
    nobody uses holds pages but takes no more.
    """
    promised = own = 0
    for path in glob.glob(os.path.join(glob.escape(shm.SHM_DIR), SHM_PREFIX + "[ug]*")):
        for meta in glob.glob(os.path.join(glob.escape(path), SHM_PREFIX + "*" + _META_SUFFIX)):
            store = os.path.basename(meta)[len(SHM_PREFIX) : -len(_META_SUFFIX)]
            capacity = _live_capacity(meta)
            if capacity is None:
                continue
            held = _held(path, store)
            if store == name:
                own += held
            else:
                promised += max(capacity - held, 0)
    return ShmClaims(shm.SHM_DIR, promised=promised, own=own)


def _live_capacity(meta: str) -> int | None:
    """The capacity in the header of the meta segment ``meta`` when a live process is
    attached to its store, else None (none attached, unreadable, damaged, half-made)."""
    try:
        fd = os.open(meta, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        raw = os.pread(fd, HEADER_WORDS * 8, 0)
        if not stat.S_ISREG(st.st_mode) or len(raw) < HEADER_WORDS * 8:
            return None
        h = np.frombuffer(raw, np.int64)
        if (
            int(h[H_MAGIC]) != MAGIC
            or int(h[H_META_SIZE]) != st.st_size
            or int(h[H_STATE]) != StoreState.READY
        ):
            return None
        if int(h[H_PID_NAMESPACE]) == pid_namespace():
            layout = Layout.of_header(h)
            _, offset, dtype, shape = next(f for f in layout.fields if f[0] == "procs")
            size = int(np.dtype(dtype).itemsize * np.prod(shape))
            procs = np.frombuffer(os.pread(fd, size, offset), dtype).reshape(shape)
            if len(procs) != shape[0] or not any_alive(procs):
                return None
        return int(h[H_CAPACITY])
    except (OSError, ValueError, CacheError):
        return None
    finally:
        os.close(fd)


def _held(directory: str, store: str) -> int:
    """Bytes of ``/dev/shm`` the files of ``store`` in ``directory`` take."""
    total = 0
    for path in glob.glob(os.path.join(glob.escape(directory), f"{SHM_PREFIX}{store}-*")):
        with contextlib.suppress(OSError):
            total += os.lstat(path).st_blocks * 512
    return total


@contextlib.contextmanager
def sizing_turn(group: int | None = None) -> Iterator[None]:
    """Hold this user's (or ``group``'s) turn to size a store and create it.

    Sizing and creating under one ``flock`` means a job started at the same moment as
    another sees the other's budget (:func:`shm_claims`). Never fails: without a
    store directory, or after :data:`SIZING_WAIT_S` (a holder stopped), the caller
    sizes without its turn.
    """
    lock = None
    try:
        access = Access(0o600 if group is None else 0o660, group)
        directory = access.ensure_directory(shm.SHM_DIR, create=True)
        lock = NodeLock(os.path.join(directory, SIZING_LOCK), create=True, access=access)
    except (CacheError, OSError) as exc:
        log.debug("sizing the memory tier without a turn: %s", exc)
    if lock is None:
        yield
        return
    turn = contextlib.ExitStack()
    try:
        turn.enter_context(lock.hold(EXCLUSIVE, timeout=SIZING_WAIT_S))
    except LockTimeout as exc:
        log.info("sizing the memory tier without a turn: %s", exc)
    try:
        with turn:
            yield
    finally:
        lock.close()
