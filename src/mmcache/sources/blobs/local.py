"""``LocalFiles``: the :class:`~mmcache.sources.blobs.base.Blobs` of a file system.

A reference is a path (``bytes`` from :meth:`~mmcache.sources.records.Records.stat_paths`
or ``str``). Its stamp is its ``stat`` (:func:`mmcache.keys.stat_fields`: size,
mtime_ns, ctime_ns, inode), taken at every batch (``StampKind.FILE``), and its identity
that of its bytes through the ledger (:mod:`mmcache.sources.identity`: equal on a
``cp -a`` copy, new when the bytes change; one ledger pass for many files). With
``content=True`` keys are made from the bytes every time (``StampKind.CONTENT``).

This wraps the identity module (the stamp and ledger logic stay there); what is here is
what :class:`~mmcache.sources.files.FileSource` did with them per sample: the ``stat``
loop, and the stamp and identity of a sample made of several files.

Stateless but for ``content``: thread- and process-safe; pickles as that flag.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache.errors import SampleError
from mmcache.rootfiles import open_regular
from mmcache.sources import identity
from mmcache.sources.base import StampKind
from mmcache.sources.bytesproc import check_size
from mmcache.sources.freshness import stat_rows

if TYPE_CHECKING:
    from mmcache.sources.blobs.base import Blobs

__all__ = ["LocalFiles", "fold_stamps"]


class LocalFiles:
    """Files on a file system (see the module docstring).

    Args:
        content: key by the bytes of every file instead of its ``stat`` stamp (for
            file systems whose ctimes or inode numbers are not trustworthy).
    """

    #: Local identities hold the file's evidence, and a record's key its path.
    location_free = False

    def __init__(self, *, content: bool = False) -> None:
        self.content = content
        self.stamp_kind = StampKind.CONTENT if content else StampKind.FILE

    def __repr__(self) -> str:
        return f"LocalFiles(content={self.content})"

    def stamps(self, refs: Sequence[str | bytes | None]) -> npt.NDArray[np.int64]:
        """:func:`mmcache.keys.stat_fields` of each file as ``int64 [n, 4]``: one
        ``stat`` each, on threads when the file system is slow to answer
        (:func:`~mmcache.sources.freshness.stat_rows`); ``-2`` where there is none (no
        file, missing, unreadable, bad path)."""
        return stat_rows([os.fsencode(r) if isinstance(r, str) else r for r in refs])

    def identities(
        self, refs: Sequence[str | bytes | None], stamps: npt.NDArray[np.int64]
    ) -> list[str]:
        """The identities of files that have a stamp, in one ledger pass
        (:func:`~mmcache.sources.identity.file_identities`: a ``stat``-equal file is
        served from the ledger)."""
        return identity.file_identities(list(refs), stamps, content=self.content)

    def identity(self, ref: str | None) -> str:
        """The identity of one file found on its own (``"none"``: no file; a missing or
        unreadable one says why)."""
        return identity.file_identity(ref, content=self.content)

    def group_stamp(self, refs: Sequence[str]) -> npt.NDArray[np.int64]:
        """``int64 [4]`` standing for the ``stat`` of every file in ``refs`` (two or more):
        :func:`fold_stamps` of their stamps."""
        row: npt.NDArray[np.int64] = self.group_stamps([refs])[0]
        return row

    def group_stamps(self, groups: Sequence[Sequence[str]]) -> npt.NDArray[np.int64]:
        """:meth:`group_stamp` of each group as ``int64 [n, 4]``, every file of every group
        ``stat``-ed in one call (a batch's multi-file samples: on threads when slow)."""
        fields = self.stamps([ref for refs in groups for ref in refs])
        out = np.empty((len(groups), 4), dtype=np.int64)
        at = 0
        for j, refs in enumerate(groups):
            out[j] = fold_stamps(fields[at : at + len(refs)])
            at += len(refs)
        return out

    def group_identity(self, refs: Sequence[str]) -> str:
        """The identity of a sample made of ``refs``: ``"none"`` for none, the file's own
        for one (as a single-file sample), each file's joined by ``|`` for more."""
        if not refs:
            return "none"
        return "|".join(self.identity(p) for p in refs)

    def read(self, ref: str, *, sample_id: str, max_bytes: int | None = None) -> bytes:
        """The bytes of the regular file ``ref``; one over ``max_bytes`` (by its
        ``fstat`` size) is refused before a byte is read. Raises SampleError."""
        try:
            fd, st = open_regular(ref)  # never blocks on a FIFO
        except OSError as exc:
            raise SampleError(f"cannot open it ({exc})", sample_id=sample_id, path=ref) from exc
        with open(fd, "rb", closefd=True) as f:
            check_size(st.st_size, max_bytes, "file", sample_id=sample_id, path=ref)
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        if max_bytes is not None and len(data) > max_bytes:  # grew while being read
            raise SampleError(
                f"file grew past the limit of {max_bytes} bytes while being read",
                sample_id=sample_id,
                path=ref,
            )
        return data

    def revalidate(self) -> list[str]:
        """Nothing to do: local files are ``stat``-ed at every batch."""
        return []


def fold_stamps(fields: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """``int64 [4]`` standing for the stamps of a sample's files (two or more), from their
    :func:`~mmcache.keys.stat_fields` rows ``fields`` (``int64 [k, 4]``, ``-2`` where a file
    has none): total size, two words of a hash of every file's fields, the count; all
    ``-2`` when one cannot be ``stat``-ed. Equal rows mean no file changed (but for a
    2**-128 chance)."""
    if (fields[:, 0] == -2).any():
        return np.full(4, -2, dtype=np.int64)
    words = np.frombuffer(xxhash.xxh3_128_digest(fields.astype("<i8").tobytes()), dtype="<i8")
    total = int(fields[:, 0].sum())
    return np.array([total, words[0], words[1], fields.shape[0]], dtype=np.int64)


if TYPE_CHECKING:  # mypy checks that LocalFiles conforms to the protocol

    def _conforms(blobs: LocalFiles) -> Blobs:
        return blobs
