"""The reject log: samples skipped under ``on_error="skip"``, listed in the process that
made the source whatever process skipped them.

Rejects found in DataLoader worker processes are appended to a small JSON-lines file
(one ``write`` with ``O_APPEND`` per reject, atomic between processes), so the parent
lists them whatever the start method (fork, spawn, forkserver). The creating process
removes the file when the log is garbage-collected; a killed creator's file is removed
by the next log made by the same user, or by ``mmcache gc`` (:func:`sweep_reject_logs`).
The creator is named in the file's name by its pid, its start time and its pid
namespace: a pid reused by a later process, which a bare pid would take for the
creator still running, is told apart by its start time (``(pid, start)`` names one
process, as in the memory tier's process table), and a log of another pid namespace
(another container sharing ``/tmp``) is left alone, its pids being meaningless here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmcache.errors import SampleError
from mmcache.stores.memory.shm import own_start_time, pid_alive, pid_namespace

__all__ = ["Reject", "RejectLog", "sweep_reject_logs"]

logger = logging.getLogger(__name__)

_REJECT_LOG_PREFIX = "mmcache-rejects-"


@dataclass(frozen=True)
class Reject:
    """A sample skipped under ``on_error="skip"``: its id, image path and the reason."""

    sample_id: str
    path: str | None
    reason: str


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


#: ``mmcache-rejects-<pid>[-s<start>-n<pid namespace>]-<random>.jsonl`` (logs made before
#: the start time and namespace were in the name have the pid alone).
_REJECT_LOG_NAME = re.compile(
    re.escape(_REJECT_LOG_PREFIX) + r"(\d+)(?:-s(\d+)-n(\d+))?-[a-z0-9_]+\.jsonl"
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _creator_gone(name: str) -> bool:
    """Whether the process that made the reject log called ``name`` has ended (False for
    a name that is not a reject log's, or a log of another pid namespace)."""
    found = _REJECT_LOG_NAME.fullmatch(name)
    if found is None:
        return False
    pid, start, namespace = found.groups()
    if start is None or int(start) == 0:
        # an older name, or a system without /proc (no start time): the pid alone, which
        # a reused pid keeps alive for a while
        return not _alive(int(pid))
    if int(namespace) != pid_namespace():
        return False
    return not pid_alive(int(pid), int(start))


def sweep_reject_logs(directory: str | None = None) -> list[str]:
    """Remove this user's reject logs in ``directory`` (default: the temporary folder,
    where logs are made) whose creating process has ended (killed, so its finalizer
    never ran); return their paths. Run by every new log and by ``mmcache gc``.
    Process-safe: a log whose creator runs is never removed."""
    removed: list[str] = []
    folder = tempfile.gettempdir() if directory is None else directory
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            if not _creator_gone(entry.name):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                    os.unlink(entry.path)
                    removed.append(entry.path)
    return removed


class RejectLog:
    """A process-shared, append-only list of rejected samples (see the module docstring).

    Made in the training process; pickled copies (DataLoader workers) append to the
    same file and never delete it. :meth:`record` is process- and thread-safe.
    """

    def __init__(self) -> None:
        sweep_reject_logs()
        creator = f"{os.getpid()}-s{own_start_time()}-n{pid_namespace()}"
        fd, self.path = tempfile.mkstemp(prefix=f"{_REJECT_LOG_PREFIX}{creator}-", suffix=".jsonl")
        os.close(fd)
        # Only the creating process removes the log; pickled copies in workers just append.
        self._finalizer: weakref.finalize[Any, Any] | None = weakref.finalize(
            self, _remove, self.path
        )

    def record(self, err: SampleError) -> None:
        """Append ``err``'s id, path and reason (one atomic O_APPEND write); never raises
        for an I/O error (the log is a convenience: training goes on)."""
        line = json.dumps({"id": err.sample_id, "path": err.path, "reason": err.reason}) + "\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode("utf-8"))
            finally:
                os.close(fd)
        except OSError as exc:
            logger.warning("cannot record reject of %r: %s", err.sample_id, exc)

    def read(self) -> list[Reject]:
        """Every reject recorded so far by any process, in order (torn lines skipped)."""
        try:
            text = Path(self.path).read_text(encoding="utf-8")
        except OSError:
            text = ""
        out = []
        for line in text.splitlines():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:  # a torn line from a killed process
                continue
            out.append(Reject(obj["id"], obj["path"], obj["reason"]))
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._finalizer = None  # copies in workers never delete the log
