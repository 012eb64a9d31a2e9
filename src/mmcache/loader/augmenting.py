"""The loader's ``augment``: a seeded random transform of each batch's images after the cache.

``DataLoader(..., augment=Augment(aug, device=None))`` runs ``aug`` on every assembled
batch, in the training process, as the first ``after_assemble`` hook (see
:mod:`mmcache.loader.hooks`): the cache keeps the un-augmented uint8 images,
and each epoch gets fresh crops. With ``device`` the images are moved there
first and the batch's ``"image"`` is on that device (the other fields stay on
the CPU).

Randomness comes from ``(seed, epoch, sample index)`` only, so the augmented
batches are bitwise the same with the cache off, cold, warm or partly warm,
with any ``num_workers`` and after ``load_state_dict`` mid-epoch:

- the built-ins of :mod:`mmcache.augment` (``RandomResizedCrop``,
  ``RandomHorizontalFlip``, ``Compose``) get one ``torch.Generator`` per row,
  seeded from ``(seed, epoch, dataset index)``;
- any other callable gets ``(images, generator)``: one CPU ``torch.Generator``
  per batch, seeded from ``(seed, epoch, batch number)``
  (:func:`mmcache.augment.batch_generator`). A library that draws from torch's
  global RNG (kornia's ``AugmentationSequential``) is seeded from it inside a
  forked RNG state::

      aug = kornia.augmentation.AugmentationSequential(
          kornia.augmentation.RandomResizedCrop((224, 224), scale=(0.9, 1.0)),
          kornia.augmentation.RandomHorizontalFlip(),
      )

      def kornia_augment(images, generator):
          seed = int(torch.randint(2**62, (1,), generator=generator))
          devices = [images.device] if images.is_cuda else []
          with torch.random.fork_rng(devices=devices):
              torch.manual_seed(seed)
              out = aug(images.float() / 255)
          return (out * 255).round().clamp(0, 255).to(torch.uint8)

      loader = DataLoader(ds, cache=cache, batch_size=64,
                          augment=Augment(kornia_augment, device="cuda"))

Images are a uint8 tensor ``[B,3,H,W]``, or for a source with varying image
shapes a list of ``[3,H_i,W_i]`` tensors (then the batch's ``image_sizes`` is
kept for a list result and dropped for a tensor one: the augment produced a
fixed size). An augment that returns something else than a tensor (or a list
of tensors), or another number of images, raises :class:`ConfigError` naming it.

Where the crops run: with ``num_workers > 0`` and the CPU crops of
:mod:`mmcache.augment` (a ``RandomResizedCrop``, then per-image transforms:
flips, colour, ``Normalize``), the loader attaches a
:class:`~mmcache.loader.croppool.CropPool` of as many crop processes as
workers (:meth:`AugmentHook.attach`): the assembler gathers the images into
shared memory and the processes crop them there, so the training process
pays the gather, not the resize. The batches are bitwise the ones
cropped here (the same per-sample generators, row by row); a batch the pool
cannot take (rows rejected, images not in shared memory, a process gone) is
cropped here.

Thread safety: batches are assembled on two threads at once. The built-ins
are safe so; any other callable is called under a lock (one batch at a time),
so that a recipe seeding the global RNG as above is safe.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from mmcache.augment import BUILTINS, batch_generator, sample_generators
from mmcache.errors import ConfigError
from mmcache.hooks import BatchContext, LoaderHook
from mmcache.loader.croppool import CropPool, poolable
from mmcache.loader.gather import BufferPool
from mmcache.loader.shmroom import ShmRoom

__all__ = ["AugmentHook"]

#: What the loader does without its crop processes (ShmRoom's warning).
_CROP_HERE = "the crops run in the training process"


class AugmentHook(LoaderHook):
    """Runs ``augment`` on each batch's ``"image"`` (on ``device`` when given)."""

    def __init__(self, augment: Any, device: str | torch.device | None = None) -> None:
        if not callable(augment):
            raise ConfigError(
                f"augment must be callable (an mmcache.augment transform, or a function "
                f"(images, generator) -> images), got {type(augment).__name__}"
            )
        try:
            self.device = torch.device(device) if device is not None else None
        except (RuntimeError, TypeError):
            raise ConfigError(
                f"device must be a torch device ('cpu', 'cuda', 'cuda:1'), got {device!r}"
            ) from None
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} but CUDA is not available: use device=None")
        self.augment = augment
        self.builtin = isinstance(augment, BUILTINS)
        self._lock = threading.Lock()
        self._crops: CropPool | None = None
        self._shm = ShmRoom()  # the loader's, once attached
        self._outputs = BufferPool(enabled=True)  # shared-memory output batches, recycled
        self._out_lock = threading.Lock()
        #: input (shape, strides) -> the output's (shape, strides, dtype), learnt here.
        self._forms: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def attach(
        self, assembler: Any, num_workers: int, context: Any, owner: object, shm: ShmRoom
    ) -> None:
        """Run the crops in ``num_workers`` crop processes when they can be (a CPU
        :func:`~mmcache.loader.croppool.poolable` augment, workers, no pinned memory,
        room in ``/dev/shm``: ``shm``, the loader's): the ``assembler`` (a
        :class:`~mmcache.loader.assemble.BatchAssembler`) then gathers images into
        shared memory. The processes stop with :meth:`close`, when ``owner`` (the
        loader) goes, or when ``/dev/shm`` is full. Called once, before the loader
        starts threads."""
        on_cpu = self.device is None or self.device.type == "cpu"
        if not on_cpu or num_workers < 1 or not poolable(self.augment) or shm.full:
            return
        if assembler.pin_memory:
            return  # pinned buffers are not shared memory
        self._shm = shm
        try:
            self._crops = CropPool(self.augment, num_workers, context)
        except OSError as exc:  # its queues' semaphores: ENOSPC in a full /dev/shm
            shm.report("crop processes' queues", exc, _CROP_HERE)
            return
        assembler.shared = frozenset({"image"})
        weakref.finalize(owner, self._crops.close)

    def close(self) -> None:
        """Stop the crop processes (later batches are cropped here). Idempotent."""
        if self._crops is not None:
            self._crops.close()

    def __repr__(self) -> str:
        return f"AugmentHook({self.augment!r}, device={self.device})"

    def after_assemble(self, batch: dict[str, Any], ctx: BatchContext) -> dict[str, Any]:
        images = batch.get("image")
        if images is None:
            raise ConfigError(
                f"augment {self.augment!r} needs an 'image' field in the batch; this "
                "pipeline has no image stage: drop augment="
            )
        if self.device is not None:
            images = _to(images, self.device)
        n = len(images)
        pooled = self._pooled(images, ctx) if self._crops is not None else None
        if pooled is not None:
            out = pooled
        elif self.builtin:
            out = self.augment(images, sample_generators(ctx.seed, ctx.epoch, ctx.indices))
            self._learn(images, out)
        else:
            with self._lock:
                out = self.augment(images, batch_generator(ctx.seed, ctx.epoch, ctx.batch))
        self._check(out, n)
        batch["image"] = out
        if isinstance(out, torch.Tensor):
            batch.pop("image_sizes", None)  # a fixed size now
        elif "image_sizes" in batch:
            sizes = [tuple(t.shape[-2:]) for t in out]
            batch["image_sizes"] = torch.tensor(sizes, dtype=torch.int64).reshape(n, 2)
        return batch

    def _pooled(self, images: Any, ctx: BatchContext) -> torch.Tensor | None:
        """The batch cropped by the crop processes, or None (crop it here)."""
        crops, probe = self._crops, self._probe_key(images)
        form = self._forms.get(probe) if probe is not None else None
        if crops is None or form is None:
            return None
        if self._shm.full:  # /dev/shm is full: batches are private from now on
            crops.close()
            return None
        shape, stride, dtype = form
        tag = repr(form).encode()
        with self._out_lock:
            held = self._outputs.acquire(tag, shape[0])
            if held is None:
                buf = torch.empty_strided(shape, stride, dtype=dtype)
                if not self._shm.share(buf, "crop output batches", _CROP_HERE):
                    crops.close()  # no room for outputs: its processes only hold memory
                    return None
                held = {"image": buf}
                self._outputs.add(tag, shape[0], held)
            out = held["image"]
        del held
        if not crops.run(images, out, ctx.seed, ctx.epoch, ctx.indices):
            return None
        return out

    def _probe_key(self, images: Any) -> tuple[Any, ...] | None:
        """The input form the crop processes take (a CPU uint8 batch in shared memory),
        or None."""
        if (
            self._crops is None
            or not isinstance(images, torch.Tensor)
            or images.dim() != 4
            or images.dtype != torch.uint8
            or images.device.type != "cpu"
            or len(images) < 1
            or not images.is_shared()  # type: ignore[no-untyped-call]
        ):
            return None
        return (tuple(images.shape), images.stride())

    def _learn(self, images: Any, out: Any) -> None:
        """Remember the form of the output the augment made of such a batch here."""
        probe = self._probe_key(images)
        if probe is not None and isinstance(out, torch.Tensor) and probe not in self._forms:
            self._forms[probe] = (tuple(out.shape), out.stride(), out.dtype)

    def _check(self, out: object, n: int) -> None:
        if isinstance(out, torch.Tensor):
            got = out.shape[0] if out.dim() else None
        elif isinstance(out, list) and all(isinstance(t, torch.Tensor) for t in out):
            got = len(out)
        else:
            raise ConfigError(
                f"augment {self.augment!r} returned {type(out).__name__}, not a tensor of "
                "images (or a list of image tensors): return the augmented images"
            )
        if got != n:
            raise ConfigError(
                f"augment {self.augment!r} returned {got} images for a batch of {n}: an "
                "augment must keep the batch size (one output image per input image)"
            )


def _to(images: torch.Tensor | list[torch.Tensor], device: torch.device) -> Any:
    if isinstance(images, torch.Tensor):
        return images.to(device, non_blocking=images.is_pinned())
    return [t.to(device, non_blocking=t.is_pinned()) for t in images]
