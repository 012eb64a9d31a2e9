"""Crop processes: the loader's random crops run outside the training process.

A warm augmented epoch spends most of the training process's CPU on the
crops (an antialiased resize per image: ~0.47 ms of 0.63 ms per sample,
measured with ``benchmarks/augment.py``'s shapes), while the loader's workers
sit idle (a warm epoch has nothing to produce). :class:`CropPool` runs the
crops of each batch in ``n`` helper processes instead, beside the workers:

- the assembled batch's images are in shared memory (the assembler allocates
  them there when a pool is attached, see
  :attr:`~mmcache.loader.assemble.BatchAssembler.shared`), so a crop process
  reads them without a copy; its output rows are written straight into a
  shared-memory output batch the training process allocated;
- a message per process per batch carries only the two tensors' handles
  (torch's shared-memory reduction: a file descriptor, mapped once per
  buffer, as the buffers are recycled), the rows and the seeds;
- each process crops rows ``lo..hi`` with each sample's own generator from
  ``(seed, epoch, dataset index)`` (:func:`mmcache.augment.sample_generators`),
  so the batch is bitwise what the training process computes itself, for any
  number of processes and any split of the rows.

Only the CPU crops of :mod:`mmcache.augment` (and the per-image transforms
after them) are sent (:func:`poolable`): their output is one tensor of one
size, computed row by row; its shape, strides and dtype are learnt from the
first batch of each input shape, which the training process crops itself.
Anything else, and a batch whose images are not in shared memory, runs in the
training process as before.

The processes are forked (the platform's default context, as torch's
DataLoader workers, unless the loader was given one) before the loader starts
any thread, and run torch with one intra-op thread (a forked OpenMP pool
hangs). A process that dies makes :meth:`CropPool.run` return False and the
pool close itself: the batch is cropped here (bitwise the same), never lost. So
does one that stalls the pool, with one warning naming it: stopped (``SIGSTOP``,
a suspended job) for :data:`_STOPPED_S` or silent for :data:`_WAIT_S`; it is
killed, as it could still write rows of a buffer the loader recycles. Each
process holds a :class:`~mmcache.loader.lifeline.Lifeline`: it ends with the
training process, even one killed with ``kill -9``.

Thread safety: :meth:`CropPool.run` may be called by the loader's two
assembling threads at once (each batch takes the whole pool under a lock, the
other waits); :meth:`close` is idempotent and safe from a finaliser.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

import numpy as np
import torch
import torch.multiprocessing  # registers torch's shared-memory reductions for the queues

from mmcache.augment import (
    ColorJitter,
    Compose,
    Normalize,
    RandomGrayscale,
    RandomHorizontalFlip,
    RandomResizedCrop,
    augment_into,
    reseed_generators,
)
from mmcache.loader.lifeline import Lifeline

__all__ = ["CropPool", "poolable"]

logger = logging.getLogger(__name__)

#: Buffers a crop process keeps mapped (sent once, then named by id): the assembler's
#: and the output pool's recycled batches.
_KEEP_MAPPED = 32
#: The transforms after the crop that see one image at a time.
_PER_IMAGE = (RandomHorizontalFlip, ColorJitter, RandomGrayscale, Normalize)
#: Seconds a batch waits for a running crop process before the pool is given up (a
#: batch's crops take milliseconds; this only bounds a process that hangs).
_WAIT_S = 30.0
#: Seconds a batch waits for a *stopped* crop process (SIGSTOP, ``scontrol suspend``)
#: before the pool is given up: a stop of a moment (a profiler's) is waited out.
_STOPPED_S = 1.0
#: Seconds between two looks at the processes while a batch waits for them.
_POLL_S = 0.25


def poolable(augment: object) -> bool:
    """Whether ``augment`` is a CPU crop a :class:`CropPool` can run: a
    :class:`RandomResizedCrop` (one output size), or a :class:`Compose` of one first and
    then transforms of one image each (flips, colour, grey, ``Normalize``), so that any
    split of a batch's rows gives the same rows."""
    if isinstance(augment, RandomResizedCrop):
        return True
    if not isinstance(augment, Compose) or not augment.transforms:
        return False
    first, *rest = augment.transforms
    return isinstance(first, RandomResizedCrop) and all(isinstance(t, _PER_IMAGE) for t in rest)


#: A tensor as a crop process is told of it: its buffer's id, the buffer itself the
#: first time (torch's shared-memory reduction: a file descriptor) else None, and its
#: dtype, offset, shape and strides in that buffer.
_Handle = tuple[tuple[int, int, int], Any, torch.dtype, int, tuple[int, ...], tuple[int, ...]]


def _buffer_id(t: torch.Tensor) -> tuple[int, int, int]:
    """The id of the shared-memory file under ``t``: its inode, device and size. Unique
    while a crop process maps it (a mapped file's inode is never reused)."""
    storage = t.untyped_storage()
    fd, size = storage._share_fd_cpu_()
    st = os.fstat(fd)
    return (st.st_ino, st.st_dev, int(size))


def _rebuild(handle: _Handle, mapped: dict[tuple[int, int, int], Any]) -> torch.Tensor:
    key, storage, dtype, offset, shape, stride = handle
    if storage is not None:
        mapped[key] = storage
    t = torch.empty(0, dtype=dtype)
    t.set_(mapped[key], offset, shape, stride)
    return t


def _serve(augment: Any, tasks: Any, done: Any, lifeline: Lifeline) -> None:
    """A crop process: ``(images, out, lo, hi, seed, epoch, indices, forget)`` -> rows
    ``lo..hi`` of ``out``; ``forget``: the ids of buffers the pool no longer sends. The
    answer on ``done`` (this process's own pipe): empty bytes (cropped) or the error's text.
    Ends with the training process (its ``lifeline``): ``tasks.get()`` never sees an EOF."""
    lifeline.hold()
    torch.set_num_threads(1)
    mapped: dict[tuple[int, int, int], Any] = {}
    generators: list[torch.Generator] = []  # reseeded for each batch (none is kept)
    while True:
        task = tasks.get()
        if task is None:
            return
        try:
            src, dst, lo, hi, seed, epoch, indices, forget = task
            images, out = _rebuild(src, mapped), _rebuild(dst, mapped)
            part, rows = images[lo:hi], out[lo:hi]
            gens = reseed_generators(generators, seed, epoch, indices)
            # A crop (and flips) resizes straight into the shared rows; anything after
            # (colour, Normalize) makes a batch of its own, copied in.
            if not augment_into(augment, part, gens, rows):
                rows.copy_(augment(part, gens))
            del images, out, part, rows, gens
            for key in forget:
                mapped.pop(key, None)
            done.send_bytes(b"")
        except Exception as exc:  # reported to the training process, which crops itself
            done.send_bytes(f"{type(exc).__name__}: {exc}".encode() or b"?")
        del task


class CropPool:
    """``n`` crop processes for one loader's ``augment`` (see the module docstring).

    Args:
        augment: a :func:`poolable` transform.
        n: processes (>= 1).
        context: a multiprocessing context or its name (None: the platform default).
    """

    def __init__(self, augment: Any, n: int, context: Any = None) -> None:
        if not poolable(augment):
            raise ValueError(f"{augment!r} is not a CPU crop a CropPool runs")
        ctx: Any = (
            mp.get_context(context) if context is None or isinstance(context, str) else context
        )
        self.augment = augment
        self._lock = threading.Lock()
        self._closed = False
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        # Per process, the buffers it maps (least recently sent first): a buffer is sent
        # once, then named by its id (a file descriptor passed per message costs ~1 ms).
        self._sent: list[collections.OrderedDict[tuple[int, int, int], None]] = []
        # Answers, one pipe per process: written by the process itself, where a shared
        # Queue goes through a feeder thread (one more thread wake-up a message in the
        # crop process, and the training process's get takes the queue's lock); each
        # wake-up costs about as much CPU as a message's pickling on this VM.
        self._done: list[Any] = []
        try:
            for _ in range(n):
                # Each queue takes two semaphores in /dev/shm: OSError (ENOSPC) when it
                # is full; the processes started so far are stopped, the caller crops.
                q = ctx.SimpleQueue()
                answers, answer = ctx.Pipe(duplex=False)
                lifeline = Lifeline.here()  # in the thread that forks, right before
                p = ctx.Process(target=_serve, args=(augment, q, answer, lifeline), daemon=True)
                p.start()
                answer.close()  # the process's end: its exit is then an EOF here
                self._done.append(answers)
                self._procs.append(p)
                self._tasks.append(q)
                self._sent.append(collections.OrderedDict())
        except BaseException:
            self._shut()
            raise

    @property
    def processes(self) -> int:
        return len(self._procs)

    def run(
        self, images: torch.Tensor, out: torch.Tensor, seed: int, epoch: int, indices: np.ndarray
    ) -> bool:
        """Crop ``images`` (shared memory, ``[B,3,H,W]``) into ``out`` (shared memory,
        the shape, strides and dtype the augment gives such a batch); False (``out``
        not written in full) when the pool is closed or a process failed: the caller
        crops the batch itself."""
        n = images.shape[0]
        with self._lock:
            if self._closed:
                return False
            k = min(len(self._procs), n)
            bounds = np.linspace(0, n, k + 1).astype(int).tolist()
            ids = (_buffer_id(images), _buffer_id(out))
            for w, (lo, hi) in enumerate(itertools.pairwise(bounds)):
                src, dst, forget = self._handles(w, images, out, ids)
                task = (src, dst, lo, hi, seed, epoch, np.asarray(indices[lo:hi]), forget)
                self._tasks[w].put(task)
            stalled = self._collect(k)
            if stalled is None:
                return True
            self._shut(stalled)
            return False

    def _handles(
        self, w: int, images: torch.Tensor, out: torch.Tensor, ids: tuple[Any, Any]
    ) -> tuple[_Handle, _Handle, list[tuple[int, int, int]]]:
        """The two tensors as process ``w`` is told of them, and the buffers it may
        forget (the least recently sent beyond :data:`_KEEP_MAPPED`)."""
        sent = self._sent[w]
        handles: list[_Handle] = []
        for t, key in zip((images, out), ids, strict=True):
            storage = None if key in sent else t.untyped_storage()
            sent[key] = None
            sent.move_to_end(key)
            offset, shape = int(t.storage_offset()), tuple(t.shape)
            handles.append((key, storage, t.dtype, offset, shape, t.stride()))
        forget = []
        while len(sent) > _KEEP_MAPPED:
            old = next(iter(sent))
            if old in ids:  # pragma: no cover - _KEEP_MAPPED >= 2
                break
            del sent[old]
            forget.append(old)
        return handles[0], handles[1], forget

    def _collect(self, k: int) -> list[int] | None:
        """Wait for the answers of processes ``0..k-1``: None when each cropped its
        rows, else the processes that stall the pool (empty: one died or failed).

        Bounded: a process stopped (``SIGSTOP``, a suspended job, a debugger) for
        :data:`_STOPPED_S`, or silent for :data:`_WAIT_S`, is given up with one
        warning naming it; the pool is then closed and the batch cropped here."""
        pending: dict[Any, int] = {self._done[w]: w for w in range(k)}
        deadline, stopped_since = time.monotonic() + _WAIT_S, dict[int, float]()
        while pending:
            answered = wait(list(pending), _POLL_S)
            for ready in answered:
                w = pending.pop(ready)
                try:
                    answer = self._done[w].recv_bytes()
                except (EOFError, OSError):  # the process is gone
                    return []
                if answer != b"":
                    pid, error = self._procs[w].pid, answer.decode(errors="replace")
                    logger.info("crop process %d failed (%s): cropping here", pid, error)
                    return []
            if not pending:
                return None
            if answered:
                continue  # answers are coming: the processes are looked at once none does
            if not all(p.is_alive() for p in self._procs):
                return []
            now = time.monotonic()
            for w in pending.values():
                if _stopped(self._procs[w].pid):
                    stopped_since.setdefault(w, now)
                else:
                    stopped_since.pop(w, None)
            stopped = sorted(w for w, t in stopped_since.items() if now - t >= _STOPPED_S)
            if stopped or now >= deadline:
                stalled = stopped or sorted(pending.values())
                self._warn_stalled(stalled, stopped=bool(stopped))
                return stalled
        return None  # pragma: no cover - the loop returns once nothing is pending

    def _warn_stalled(self, stalled: list[int], *, stopped: bool) -> None:
        pids = ", ".join(str(self._procs[w].pid) for w in stalled)
        why = (
            f"stopped (SIGSTOP, a suspended job or a debugger) for {_STOPPED_S:.0f} s"
            if stopped
            else f"silent for {_WAIT_S:.0f} s"
        )
        logger.warning(
            "crop process(es) %s %s: the loader stops them and crops in the training process"
            " from now on (the batches are the same)",
            pids,
            why,
        )

    def _shut(self, stalled: Sequence[int] = ()) -> None:
        """Stop every process (``stalled`` ones at once: they answer nothing)."""
        self._closed = True
        for w in stalled:
            self._procs[w].kill()
        for q, p in zip(self._tasks, self._procs, strict=True):
            if p.is_alive():
                with contextlib.suppress(OSError):  # its pipe may be gone with it
                    q.put(None)
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for answers in self._done:
            answers.close()

    def close(self) -> None:
        """Stop the processes. Idempotent."""
        with self._lock:
            if not self._closed:
                self._shut()


def _stopped(pid: int | None) -> bool:
    """Whether process ``pid`` is stopped (state ``T``, or ``t``: traced), per /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")
