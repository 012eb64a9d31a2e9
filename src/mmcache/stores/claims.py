"""Production claims: one preparation per node when several processes miss the same key.

Several jobs on one node with the same pipeline and the same order (a learning-rate sweep
started together) miss the same keys at the same moment. Without a claim each job decodes
each sample itself: K jobs, K decodes, and each job's epoch is slower than one job alone.
With a claim, the first process to miss a key marks it ("I am producing this"); a process
that misses it while the mark stands waits until the mark goes, then looks the key up
again and finds the entry the producer just published.

The mark is an open-file-description lock (``F_OFD_SETLK``) on one byte of the memory
tier's lock file, at an offset hashed from the key:

* **Liveness comes from the kernel.** A producer killed with ``kill -9`` closes its file
  descriptors as it dies, and the kernel drops its locks with them: a waiter never waits
  for a process that is gone. A live producer that is stuck is bounded by the waiter's
  ``timeout``, after which the waiter produces the sample itself.
* **Per descriptor, not per process.** Classic POSIX record locks (``lockf``) belong to
  the process, so two threads of one process would both "hold" a key; OFD locks belong
  to the open file description, and each claim opens its own. A claim is released with
  an explicit ``F_UNLCK`` before the close, so a child forked while the claim was held
  (whose copy of the descriptor shares the description) cannot keep it alive.
* **No new files.** The memory tier's lock file already exists for the tier's lifetime,
  with the tier's owner and mode; OFD record locks are independent of the ``flock`` the
  tier takes on the same file, and locks beyond the end of a file need no bytes there.
  Nothing needs cleaning up, and a removed tier leaves nothing behind.

Two keys can hash to one byte (2**20 slots: with a few dozen samples in flight on a node
a collision is rare); a collision only makes one process wait for an unrelated sample,
never serves anything: after a wait the waiter looks its own key up and produces it if it
is absent. A claim never makes a wrong entry visible; at worst a sample is produced twice,
as without claims.

Rejected: a "producing" state per entry in the shared memory table (the liveness of the
producer would then have to be checked by pid, racing pid reuse, and every writer would
need the table's lock to set and clear it); a lock file per key (a file per in-flight
sample, and unlinking a lock file races with the next process opening it).

Thread/process safety: :meth:`Claims.acquire` may be called from any thread of any process
on the node; each returned :class:`Claim` is owned by its caller.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time
from dataclasses import dataclass
from types import TracebackType

import xxhash

__all__ = ["CLAIM_SLOTS", "Claim", "Claims"]

#: Slots (bytes of the lock file) that keys hash to.
CLAIM_SLOTS = 1 << 20
#: ``struct flock`` for x86-64/aarch64 Linux: l_type, l_whence, l_start, l_len, l_pid (+pad).
_FLOCK = "hhqqi4x"
_HELD = (errno.EAGAIN, errno.EACCES)


def _flock(kind: int, slot: int) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, slot, 1, 0)  # l_pid must be 0 for OFD


@dataclass
class Claim:
    """A held claim on one key (or a waiter's pass when the wait timed out: ``fd == -1``).

    ``waited``: whether another process held the key when it was asked for; the caller
    then looks the key up again before producing it.
    """

    fd: int
    slot: int
    waited: bool

    def release(self) -> None:
        """Drop the claim (idempotent)."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, self.slot))
        finally:
            os.close(fd)

    def __enter__(self) -> Claim:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class Claims:
    """The node's production claims of one cache, kept on the byte ranges of ``path``.

    ``path``: an existing file every process of the cache can open read-write (the memory
    tier's lock file). ``timeout``: the longest a waiter waits for another process's claim
    before it produces the key itself. Picklable (a path and two numbers): workers get it
    with the cache.
    """

    def __init__(self, path: str, *, timeout: float = 30.0, poll: float = 0.002) -> None:
        self.path = path
        self.timeout = timeout
        self.poll = poll

    def __repr__(self) -> str:
        return f"Claims({self.path!r}, timeout={self.timeout})"

    @staticmethod
    def slot(key: bytes) -> int:
        """The byte of the lock file that ``key`` hashes to."""
        return xxhash.xxh3_64_intdigest(key) % CLAIM_SLOTS

    def acquire(self, key: bytes, *, wait: bool = True) -> Claim | None:
        """Claim ``key``, waiting (up to ``timeout``) while another process holds it.

        Returns the held :class:`Claim` (its ``waited`` says whether someone else held it
        first), a pass with ``fd == -1`` when the wait timed out (produce anyway, unclaimed)
        or, with ``wait=False``, at once when another holder has it (do other work first,
        then come back), or None when claims cannot be used here (the file is gone or
        cannot be locked): the caller then simply produces, as without claims.
        """
        slot = self.slot(key)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        request = _flock(fcntl.F_WRLCK, slot)
        waited = False
        deadline = time.monotonic() + (self.timeout if wait else 0.0)
        pause = self.poll
        try:
            while True:
                try:
                    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)
                    return Claim(fd, slot, waited)
                except OSError as exc:
                    if exc.errno not in _HELD:
                        os.close(fd)
                        return None
                waited = True
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return Claim(-1, slot, waited)
                # Poll, not F_OFD_SETLKW: a blocking wait cannot be given a deadline.
                # A decode takes milliseconds; start near that and back off a little.
                time.sleep(pause)
                pause = min(pause * 1.5, 0.02)
        except BaseException:
            os.close(fd)
            raise
