"""The reject log: samples skipped under ``on_error="skip"``, listed in the process that
made the source whatever process skipped them.

Rejects found in DataLoader worker processes are appended to a small JSON-lines file
(one ``write`` with ``O_APPEND`` per reject, atomic between processes), so the parent
lists them whatever the start method (fork, spawn, forkserver). The creating process
removes the file when the log is garbage-collected; a killed creator's file is removed
by the next log made by the same user (the creator's pid is in the name).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmcache.errors import SampleError

__all__ = ["Reject", "RejectLog"]

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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_stale_reject_logs(directory: str) -> None:
    """Remove this user's reject logs whose creating process is gone (killed, so its
    finalizer never ran). The creator's pid is in the name (``mmcache-rejects-<pid>-*``);
    a reused pid only keeps a stale log for a while, it never removes a live one."""
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            if not (name.startswith(_REJECT_LOG_PREFIX) and name.endswith(".jsonl")):
                continue
            pid = name[len(_REJECT_LOG_PREFIX) :].split("-", 1)[0]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid == os.getuid():
                    os.unlink(entry.path)


class RejectLog:
    """A process-shared, append-only list of rejected samples (see the module docstring).

    Made in the training process; pickled copies (DataLoader workers) append to the
    same file and never delete it. :meth:`record` is process- and thread-safe.
    """

    def __init__(self) -> None:
        _remove_stale_reject_logs(tempfile.gettempdir())
        fd, self.path = tempfile.mkstemp(
            prefix=f"{_REJECT_LOG_PREFIX}{os.getpid()}-", suffix=".jsonl"
        )
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
