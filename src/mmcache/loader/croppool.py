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
pool close itself: the batch is cropped here (bitwise the same), never lost.

Thread safety: :meth:`CropPool.run` may be called by the loader's two
assembling threads at once (each batch takes the whole pool under a lock, the
other waits); :meth:`close` is idempotent and safe from a finaliser.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import multiprocessing as mp
import os
import threading
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

__all__ = ["CropPool", "poolable"]

#: Buffers a crop process keeps mapped (sent once, then named by id): the assembler's
#: and the output pool's recycled batches.
_KEEP_MAPPED = 32
#: The transforms after the crop that see one image at a time.
_PER_IMAGE = (RandomHorizontalFlip, ColorJitter, RandomGrayscale, Normalize)
#: Seconds a batch waits for a crop process before the pool is given up.
_WAIT_S = 60.0


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


def _serve(augment: Any, tasks: Any, done: Any) -> None:
    """A crop process: ``(images, out, lo, hi, seed, epoch, indices, forget)`` -> rows
    ``lo..hi`` of ``out``; ``forget``: the ids of buffers the pool no longer sends. The
    answer on ``done`` (this process's own pipe): empty bytes (cropped) or the error's text."""
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
        for _ in range(n):
            q = ctx.SimpleQueue()
            answers, answer = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_serve, args=(augment, q, answer), daemon=True)
            p.start()
            answer.close()  # the process's end: its exit is then an EOF here
            self._done.append(answers)
            self._procs.append(p)
            self._tasks.append(q)
            self._sent.append(collections.OrderedDict())

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
            ok = True
            for w in range(k):
                if not self._wait(w):
                    ok = False
                    break
            if not ok:
                self._shut()
            return ok

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

    def _wait(self, w: int) -> bool:
        """Crop process ``w``'s answer: True when it cropped its rows."""
        waited, answers = 0.0, self._done[w]
        while True:
            try:
                if answers.poll(0.5):
                    return bool(answers.recv_bytes() == b"")
            except (EOFError, OSError):  # the process is gone
                return False
            waited += 0.5
            if waited >= _WAIT_S or not all(p.is_alive() for p in self._procs):
                return False

    def _shut(self) -> None:
        self._closed = True
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
