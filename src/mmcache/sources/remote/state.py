"""``SharedStamps``: the object stamps a source revalidated, handed to its copies in other
processes (DataLoader workers, persistent or not) through one small JSON file.

The process that revalidates (the training process, before an epoch) :meth:`publish`-es
the new stamps (written to a temporary name and renamed: readers see a whole file or the
old one); every copy :meth:`poll`-s before it keys or produces a sample, which costs one
``stat`` while nothing changed. A copy made before the file existed, or pickled from a
process that had already read it, takes only later versions.

Process-safe (rename is atomic); one thread per process polls.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any

__all__ = ["SharedStamps"]


class SharedStamps:
    """The file at ``path`` (its directory is created on the first publish)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mtime = -1
        with contextlib.suppress(OSError):  # an older run's revalidations are not ours
            self._mtime = os.stat(path).st_mtime_ns

    def publish(self, payload: dict[str, Any]) -> None:
        """Write ``payload`` (JSON data) for the other processes."""
        directory = os.path.dirname(self.path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(payload, out)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        with contextlib.suppress(OSError):
            self._mtime = os.stat(self.path).st_mtime_ns

    def poll(self) -> dict[str, Any] | None:
        """The payload published since the last look, else ``None`` (one ``stat``)."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return None
        if mtime == self._mtime:
            return None
        self._mtime = mtime
        try:
            if os.stat(self.path).st_uid != os.getuid():  # only our own processes publish
                return None
            with open(self.path, encoding="utf-8") as fh:
                payload = json.load(fh)
        except (OSError, ValueError):
            return None
        return payload if isinstance(payload, dict) else None
