"""``SharedStamps``: the object stamps a source revalidated, handed to its copies in other
processes (DataLoader workers, persistent or not) through one small JSON file, and the
gate that holds those copies back while a revalidation is under way.

The process that revalidates (the training process, before an epoch) :meth:`publish`-es
the new stamps (written to a temporary name and renamed: readers see a whole file or the
old one); every copy :meth:`poll`-s before it keys or produces a sample, which costs one
``stat`` while nothing changed. A copy made before the file existed, or pickled from a
process that had already read it, takes only later versions.

The revalidation may run while the epoch's first batches are gathered
(:class:`~mmcache.sources.blobs.prefetch.RemotePrefetch`): :meth:`begin` marks it
under way (a ``.pending`` file beside the state file), and until :meth:`end` every
:meth:`poll`, in any process, waits (at most ``pending_s`` seconds after the mark, so a
crashed reviser never blocks anyone). A batch gathered meanwhile is checked against the
source's keys once the answer is in, so an object overwritten between two epochs is
never served in the second.

Where: the source's folder under the cache root (the raw tier's), or
:func:`private_dir`, a 0700 folder of this user. Never a computable name in a shared
temporary directory (another user could create it first). A state file owned by another
user is refused at construction with a :class:`~mmcache.errors.ConfigError`; a publish
that fails is a warning (the other processes then re-key on their next revalidation).

Process-safe (rename is atomic); one thread per process polls.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import tempfile
import time
from typing import Any

from mmcache.errors import ConfigError
from mmcache.rootfiles import replace_file

__all__ = ["SharedStamps", "private_dir"]

logger = logging.getLogger(__name__)

#: The longest a poll waits for a revalidation under way (a crashed one is ignored after).
PENDING_S = 60.0
_POLL_S = 0.002
#: The largest state file read back.
_MAX_BYTES = 256 << 20


def private_dir() -> str:
    """A folder only this user can enter: ``$XDG_RUNTIME_DIR/mmcache`` when that is set,
    else ``<tmp>/mmcache-<uid>``; created 0700. Raises :class:`ConfigError` when it
    exists and is not this user's own 0700 folder (another user made it first)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        path = os.path.join(runtime, "mmcache")
    else:
        path = os.path.join(tempfile.gettempdir(), f"mmcache-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(
            f"{path} is not a private folder of this user (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}): another user may have made it; pass "
            "state_dir= (a folder under the cache root) or remove it"
        )
    return path


class SharedStamps:
    """The file at ``path`` (its directory is created on the first publish).

    Raises :class:`ConfigError` when ``path`` exists and is not this user's regular file.
    """

    def __init__(self, path: str, *, pending_s: float = PENDING_S) -> None:
        self.path = path
        self.pending_path = path + ".pending"
        self.pending_s = pending_s
        self._mtime = -1
        try:
            st = os.lstat(path)
        except OSError:
            return
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise ConfigError(
                f"the state file {path} belongs to uid {st.st_uid} (not this user, "
                f"{os.getuid()}) or is not a regular file: it was not made by this job; "
                "pass state_dir= a folder of your own (e.g. under the cache root)"
            )
        self._mtime = st.st_mtime_ns  # an older run's revalidations are not ours

    def _write(self, path: str, text: str) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        replace_file(path, text.encode("utf-8"), 0o600)

    def publish(self, payload: dict[str, Any]) -> bool:
        """Write ``payload`` (JSON data) for the other processes; ``False`` (and a
        warning) when it cannot be written."""
        try:
            self._write(self.path, json.dumps(payload))
        except OSError as exc:
            logger.warning(
                "cannot hand the revalidated stamps to other processes through %s: %s",
                self.path,
                exc,
            )
            return False
        with contextlib.suppress(OSError):
            self._mtime = os.stat(self.path).st_mtime_ns
        return True

    def begin(self) -> None:
        """A revalidation is under way: polls wait for :meth:`end` (see the module doc)."""
        try:
            self._write(self.pending_path, str(os.getpid()))
        except OSError as exc:
            logger.warning(
                "cannot mark the revalidation under way (%s): %s", self.pending_path, exc
            )

    def end(self) -> None:
        """The revalidation has answered (or failed): polls go on."""
        with contextlib.suppress(OSError):
            os.unlink(self.pending_path)

    def wait(self, clock: Any = time.time) -> None:
        """Wait while a revalidation is under way (one ``stat`` when none is)."""
        while True:
            try:
                st = os.stat(self.pending_path)
            except OSError:
                return
            if st.st_uid != os.getuid() or clock() - st.st_mtime > self.pending_s:
                return  # another user's, or left by a crashed process
            time.sleep(_POLL_S)

    def poll(self) -> dict[str, Any] | None:
        """The payload published since the last look, else ``None`` (one ``stat``, two
        while a revalidation is under way, which it waits for)."""
        self.wait()
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return None
        if mtime == self._mtime:
            return None
        self._mtime = mtime
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_size > _MAX_BYTES:
                return None  # only our own processes publish
            with os.fdopen(os.dup(fd), encoding="utf-8") as fh:
                payload = json.load(fh)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        return payload if isinstance(payload, dict) else None
