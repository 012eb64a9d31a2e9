"""Which pipeline fingerprints wrote into a cache root, and which keys each wrote.

Cache keys are digests, so an entry does not say which pipeline made it. To
list the fingerprints present (``mmcache stats``) and to drop the entries of a
pipeline nobody uses any more (``mmcache gc --unused-for 30d``), writers that
know their fingerprint tag their puts: each tagged key is appended to
``root/fingerprints/<fingerprint>.keys`` as a line of 32 hex digits (one
``O_APPEND`` write, atomic between processes), and ``<fingerprint>.json``
records a description and when the fingerprint was first and last used.
Lines, not raw 16-byte records: a write torn by a full disk spoils only the
line it is in, and the next newline resynchronises the log (a torn binary
record would shift every later key).

The files are untrusted input like every cache file: the key log is read as
hex lines (anything else is skipped), the JSON is plain data (at most
:data:`RECORD_MAX_BYTES`), every file is read only if it is a regular one (a
FIFO planted by a member of a shared root would block the reader:
:func:`~mmcache.rootfiles.open_regular`), and file names
come only from validated hex fingerprints. Deleting the keys of one
fingerprint can never touch another's entries, since every key includes its
fingerprint. Process-safe; thread-safe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mmcache.rootfiles import (
    UnsafeFileError,
    make_dir,
    open_file,
    open_regular,
    read_regular,
    replace_file,
)
from mmcache.stores.base import KEY_SIZE, dir_mode

__all__ = ["FingerprintInfo", "FingerprintRegistry"]

logger = logging.getLogger(__name__)

_FP_RE = re.compile(r"^[0-9a-f]{8,64}$")
#: The most bytes a fingerprint's JSON record may have (its description is cut at 500).
RECORD_MAX_BYTES = 64 * 1024


def _record(path: Path) -> Any:
    """The JSON record at ``path``; OSError or ValueError when it cannot be read."""
    return json.loads(read_regular(path, max_bytes=RECORD_MAX_BYTES))


@dataclass(frozen=True)
class FingerprintInfo:
    """One fingerprint of a cache root: keys logged for it and when it was used."""

    fingerprint: str
    description: str
    first_used: float
    last_used: float
    keys_logged: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check(fp: str) -> str:
    if not isinstance(fp, str) or _FP_RE.match(fp) is None:
        raise ValueError(f"a fingerprint is 8-64 lowercase hex digits, got {fp!r}")
    return fp


class FingerprintRegistry:
    """The ``fingerprints/`` folder of a cache root."""

    def __init__(self, folder: str | os.PathLike[str], *, mode: int = 0o600) -> None:
        self.folder = Path(folder)
        self.mode = mode
        make_dir(self.folder, dir_mode(mode))  # exact mode, setgid kept, never a link
        self._unsafe: set[str] = set()  # fingerprints whose key log was refused

    def touch(self, fp: str, description: str, now: float) -> None:
        """Record that ``fp`` is in use now (atomic replace of its JSON)."""
        path = self.folder / f"{_check(fp)}.json"
        first = now
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            first = float(_record(path)["first_used"])
        data = {
            "fingerprint": fp,
            "description": description[:500],
            "first_used": first,
            "last_used": now,
        }
        try:
            replace_file(path, json.dumps(data).encode(), self.mode)
        except OSError as exc:  # e.g. a full disk (replace_file leaves nothing behind)
            logger.debug("cannot record fingerprint %s: %s", fp, exc)

    def log(self, fp: str, keys: Iterable[bytes]) -> None:
        """Append ``keys`` to the key log of ``fp`` (one atomic write)."""
        data = b"".join(k.hex().encode("ascii") + b"\n" for k in keys if len(k) == KEY_SIZE)
        if not data:
            return
        path = self.folder / f"{_check(fp)}.keys"
        try:
            # The name is in the folder's listing: a member may have swapped the log for
            # a link to one of our files. open_file follows no link and refuses a hard
            # link; only a log it created gets our mode.
            fd, _ = open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, self.mode)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except UnsafeFileError as exc:
            if fp not in self._unsafe:  # once: log() runs for every batch of puts
                self._unsafe.add(fp)
                logger.warning("not logging keys of fingerprint %s: %s", fp, exc)
        except OSError as exc:  # a full disk must not stop training over bookkeeping
            logger.debug("cannot log keys of fingerprint %s: %s", fp, exc)

    def keys(self, fp: str) -> Iterator[bytes]:
        """The keys logged for ``fp`` (a torn last record is ignored)."""
        path = self.folder / f"{_check(fp)}.keys"
        try:
            fd, _ = open_regular(path)
            with open(fd, "rb", closefd=True) as f:
                data = f.read()
        except OSError:
            return
        for line in data.split(b"\n"):
            if len(line) == 2 * KEY_SIZE:
                with contextlib.suppress(ValueError):
                    yield bytes.fromhex(line.decode("ascii"))

    def entries(self) -> list[FingerprintInfo]:
        """Every fingerprint of this root, most recently used first (``keys_logged`` is
        estimated from the log's size)."""
        out = []
        for path in self.folder.glob("*.json"):
            fp = path.stem
            if _FP_RE.match(fp) is None:
                continue
            try:
                data = _record(path)
                first, last = float(data["first_used"]), float(data["last_used"])
                desc = str(data.get("description", ""))
            except (OSError, ValueError, TypeError, KeyError):
                continue
            keys_path = self.folder / f"{fp}.keys"
            n = keys_path.stat().st_size // (2 * KEY_SIZE + 1) if keys_path.exists() else 0
            out.append(FingerprintInfo(fp, desc, first, last, n))
        return sorted(out, key=lambda e: -e.last_used)

    def remove(self, fp: str) -> None:
        for suffix in (".json", ".keys"):
            with contextlib.suppress(FileNotFoundError):
                (self.folder / f"{_check(fp)}{suffix}").unlink()
