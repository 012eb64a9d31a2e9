"""The loader's ``augment``: a seeded random transform of each batch's images after the cache.

``DataLoader(..., augment=aug, device=None)`` runs ``aug`` on every assembled
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

      loader = DataLoader(ds, cache=cache, batch_size=64, augment=kornia_augment, device="cuda")

Images are a uint8 tensor ``[B,3,H,W]``, or for a source with varying image
shapes a list of ``[3,H_i,W_i]`` tensors (then the batch's ``image_sizes`` is
kept for a list result and dropped for a tensor one: the augment produced a
fixed size). An augment that returns something else than a tensor (or a list
of tensors), or another number of images, raises :class:`ConfigError` naming it.

Thread safety: batches are assembled on two threads at once. The built-ins
are safe so; any other callable is called under a lock (one batch at a time),
so that a recipe seeding the global RNG as above is safe.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from mmcache.augment import BUILTINS, batch_generator, sample_generators
from mmcache.errors import ConfigError
from mmcache.hooks import BatchContext, LoaderHook

__all__ = ["AugmentHook"]


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
        if self.builtin:
            out = self.augment(images, sample_generators(ctx.seed, ctx.epoch, ctx.indices))
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
