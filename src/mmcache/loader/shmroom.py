"""``ShmRoom``: the loader's own shared memory, and what it does when ``/dev/shm`` is full.

Besides the cache's memory tier (which refuses puts when ``/dev/shm`` is full, see
:mod:`mmcache.stores.memory.layout`), the loader keeps a few pieces of its own in
``/dev/shm``, each with a way to do without:

- the batch tensors the crop processes read (the
  :class:`~mmcache.loader.assemble.BatchAssembler`'s): private ones instead, the
  crops run in the training process;
- the crop processes' output batches: the crops run in the training process;
- the crop processes' queues (POSIX semaphores): no crop processes;
- the stat prefetcher's lock and semaphore: no guessed epochs, the workers plan each;
- the epoch gate's lock and semaphores: workers that are not persistent;
- the workers' queues (torch's, semaphores): the training process plans and produces
  every batch (as with ``num_workers=0``).

The batches are bitwise the same either way (the crops are seeded per sample), so a
full ``/dev/shm`` costs speed, never a crash. One :class:`ShmRoom` per loader
records the first shortage with one warning; from then on (``full``) the loader makes
none of its own pieces there (the workers are still started: their queues take a
few pages, and without them the training process produces every miss), and later
shortages are logged at INFO.

torch's ``share_memory_`` names its file (``/dev/shm/torch_<pid>_<n>_<n>``) before it
reserves its pages and unlinks it only once they are mapped: when the reservation
fails (``ENOSPC``) the name is left behind, one per failure. torch names that file
only in the error's message, so :meth:`ShmRoom.share` takes it from there and
removes it when it is this process's.

Thread safety: :meth:`ShmRoom.share` and :meth:`ShmRoom.report` may be called from
any thread of the training process (the loader's two assembling threads).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading

import torch

__all__ = ["ShmRoom"]

logger = logging.getLogger(__name__)

#: Where POSIX shared memory (``shm_open``, so torch's files) lives on Linux.
_POSIX_SHM = "/dev/shm"
#: The file name in torch's "unable to allocate shared memory(shm) for file </name>".
_TORCH_FILE = re.compile(r"</(torch_(\d+)_\d+_\d+)>")


class ShmRoom:
    """Whether one loader may still put its own pieces in ``/dev/shm`` (see the module)."""

    def __init__(self) -> None:
        #: A piece found no room: the loader puts nothing more of its own in /dev/shm.
        self.full = False
        self._lock = threading.Lock()

    def share(self, tensor: torch.Tensor, piece: str, without: str) -> bool:
        """Move ``tensor`` into shared memory; False when it stays private: ``/dev/shm``
        has no room (reported, see :meth:`report`), or had none before."""
        if self.full:
            return False
        try:
            tensor.share_memory_()  # type: ignore[no-untyped-call]
        except RuntimeError as exc:  # torch's error for any failed shared allocation
            _remove_leftover(str(exc))
            self.report(piece, exc, without)
            return False
        return True

    def report(self, piece: str, exc: BaseException, without: str) -> None:
        """``piece`` found no room in ``/dev/shm`` (``exc``); the loader goes on
        ``without`` it. The first report of this loader is a warning."""
        with self._lock:
            first, self.full = not self.full, True
        if first:
            logger.warning(
                "cannot place the loader's %s in /dev/shm (%s): %s. The loader uses no more "
                "shared memory of its own; the batches are the same (free /dev/shm or make "
                "it larger: docker run --shm-size)",
                piece,
                exc,
                without,
            )
        else:
            logger.info("cannot place the loader's %s in /dev/shm either: %s", piece, without)


def _remove_leftover(message: str) -> None:
    """Remove the file a failed ``share_memory_`` of this process left (see the module)."""
    found = _TORCH_FILE.search(message)
    if found is None or int(found.group(2)) != os.getpid():
        return  # not named, or another process's (never ours to remove)
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(_POSIX_SHM, found.group(1)))
