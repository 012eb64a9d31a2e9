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
* **A stopped producer is not waited for.** A job stopped while it produces (Ctrl-Z,
  ``kill -STOP``, ``scontrol suspend``) keeps its claim, alive but making no progress.
  After ``notice`` seconds of waiting, the waiter looks the holder up once (OFD locks do
  not name their owner: ``F_OFD_GETLK`` says pid -1, so the ``/proc/<pid>/fdinfo`` of
  the processes that have the lock file open is read, a cost paid once per long wait): a
  stopped one (state ``T``/``t``) gets one warning naming its pid and the key, and the
  waiter produces the sample at once. A running one is waited for up to ``timeout``
  (30 s: a slow decode, a long clip, is worth waiting for rather than doing twice), then
  one warning names it and the key, and the waiter produces the sample itself.
  Rejected: a shorter timeout for every holder (a slow but healthy decode would be done
  twice on a loaded node); recording each holder's pid beside its lock (a write per
  claim, on the hot path, for a lookup needed only when a wait lasts).
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
import logging
import os
import struct
import time
from dataclasses import dataclass
from types import TracebackType

import xxhash

__all__ = ["CLAIM_SLOTS", "STOPPED", "Claim", "Claims", "claim_holders", "process_state"]

logger = logging.getLogger(__name__)

#: Slots (bytes of the lock file) that keys hash to.
CLAIM_SLOTS = 1 << 20
#: Process states (``/proc/<pid>/stat``) of a process that makes no progress until resumed.
STOPPED = ("T", "t")
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
    before it produces the key itself. ``notice``: after this long a waiter looks the
    holder up, and does not wait for a stopped one (see the module docstring). Picklable
    (a path and three numbers): workers get it with the cache.
    """

    def __init__(
        self, path: str, *, timeout: float = 30.0, poll: float = 0.002, notice: float = 1.0
    ) -> None:
        self.path = path
        self.timeout = timeout
        self.poll = poll
        self.notice = notice

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
        cannot be locked): the caller then simply produces, as without claims. A pass
        given early (the holder is stopped) or at ``timeout`` is logged, once, as a
        warning naming the holder's pid and the key.
        """
        slot = self.slot(key)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        request = _flock(fcntl.F_WRLCK, slot)
        waited = False
        start = time.monotonic()
        deadline = start + (self.timeout if wait else 0.0)
        looked = not wait  # the holder is looked up once, after ``notice``
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
                now = time.monotonic()
                if not looked and now - start >= min(self.notice, self.timeout):
                    looked = True
                    stopped = [p for p, state in claim_holders(self.path, slot) if state in STOPPED]
                    if stopped:
                        logger.warning(
                            "key %s: pid %s, which claimed it to produce it, is stopped "
                            "(SIGSTOP, Ctrl-Z, a suspended job): producing it here instead "
                            "of waiting (resume or end that process)",
                            key.hex(), ", ".join(map(str, stopped)),
                        )  # fmt: skip
                        os.close(fd)
                        return Claim(-1, slot, waited)
                if now >= deadline:
                    if wait:
                        logger.warning(
                            "key %s: waited %.1f s for %s to produce it; producing it here",
                            key.hex(), now - start, _holders_text(claim_holders(self.path, slot)),
                        )  # fmt: skip
                    os.close(fd)
                    return Claim(-1, slot, waited)
                # Poll, not F_OFD_SETLKW: a blocking wait cannot be given a deadline.
                # A decode takes milliseconds; start near that and back off a little.
                time.sleep(pause)
                pause = min(pause * 1.5, 0.02)
        except BaseException:
            os.close(fd)
            raise


def claim_holders(path: str, slot: int) -> list[tuple[int, str]]:
    """The processes holding the claim on byte ``slot`` of ``path``, each with its state
    letter (``R``, ``S``, ``D``, ``T``... of ``/proc/<pid>/stat``).

    OFD locks do not name their owner (``F_OFD_GETLK`` answers pid -1), so this reads
    ``/proc``: each descriptor, of each process this one may inspect, that opens
    ``path``, and the lock lines of its ``fdinfo``. Some thousands of ``stat`` calls on
    a busy node: for a wait that has already lasted, never on the hot path. The holder
    of another user (a shared root) may be invisible from here: then the list is empty.
    Linux only (as claims are); process-safe, reads only.
    """
    try:
        st = os.stat(path)
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    held = f" {slot} {slot}"  # a lock line ends with its first and last byte
    found: list[tuple[int, str]] = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or not ours to inspect
        for fd in fds:
            try:
                target = os.stat(f"/proc/{pid}/fd/{fd}")
                if (target.st_dev, target.st_ino) != (st.st_dev, st.st_ino):
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as info:
                    lines = info.read().splitlines()
            except OSError:
                continue
            if any(ln.startswith("lock:") and "OFDLCK" in ln and ln.endswith(held) for ln in lines):
                found.append((pid, process_state(pid)))
                break
    return found


def process_state(pid: int) -> str:
    """The state letter of ``pid`` (``R``, ``S``, ``D``, ``T``...; :data:`STOPPED`: it
    makes no progress until resumed), ``?`` when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            line = f.read()
    except OSError:
        return "?"
    rest = line[line.rfind(b")") + 2 :]  # (the command name may hold spaces and parentheses)
    return rest[:1].decode(errors="replace") or "?"


def _holders_text(holders: list[tuple[int, str]]) -> str:
    """``"pid 123 (state R)"``, or what is known when no holder is visible from here."""
    if not holders:
        return "the process that claimed it (not visible from here: another user's?)"
    return ", ".join(f"pid {pid} (state {state})" for pid, state in holders)
