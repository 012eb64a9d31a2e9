"""The loader's hook contract: after each batch is assembled, and before each epoch begins.

``DataLoader(..., hooks=[hook, ...])`` takes objects with either or both of

- ``after_assemble(batch, ctx) -> batch``: called with every batch once it is
  assembled, whichever way (gathered from learnt keys in a guessed epoch, or
  planned and filled in), before the training loop sees it; returns the batch
  to yield (the same dict changed in place, or a new one). ``ctx`` is a
  :class:`BatchContext`: the epoch, the batch's number and the dataset index
  of each row, with the loader's seed, rank and world size, which is what a
  seeded per-sample transform needs (augmentation after the cache: the cached
  bytes stay the un-augmented ones).
- ``before_epoch(ctx) -> None``: called in the training process each time an
  iteration over an epoch begins, before any batch of it is planned or any
  worker is let into it (a resumed or re-entered epoch calls it again).
  ``ctx`` is an :class:`EpochContext`, whose ``batches(e)`` gives this rank's
  batches of any epoch (what an exchange of samples between nodes before the
  epoch needs).

Hooks run in the order given (:class:`mmcache.loader.hooks.Hooks` runs them).
:class:`LoaderHook` is a base class with no-op defaults; any object with one of
the two methods will do.

This module is the contract alone, in the base layer, so that whoever writes a hook
(the loader's own, :mod:`mmcache.cluster`, :mod:`mmcache.sources.blobs.prefetch`)
types against it without importing the loader.

Thread safety: ``after_assemble`` runs on the loader's assembling threads (its
helper thread and the training loop's own), possibly for two batches at once;
``before_epoch`` runs in the thread that iterates the loader. A batch's
tensors may be recycled buffers: a hook may change them in place, but must not
keep references to them after it returns.

>>> class Flip(LoaderHook):
...     def after_assemble(self, batch, ctx):
...         batch["image"] = batch["image"].flip(-1)
...         return batch
>>> loader = DataLoader(ds, cache=cache, batch_size=64, hooks=[Flip()])  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["BatchContext", "EpochContext", "LoaderHook"]


@dataclass(frozen=True)
class EpochContext:
    """What a ``before_epoch`` hook is told: the epoch, the batch it starts at (non-zero
    when resumed), how many batches it has, and ``batches(e)``: this rank's batches
    (index arrays) of any epoch ``e``."""

    epoch: int
    start: int
    num_batches: int
    batches: Callable[[int], list[np.ndarray]]


@dataclass(frozen=True)
class BatchContext:
    """What an ``after_assemble`` hook is told about a batch: its epoch, its number
    in the epoch, each row's dataset index, the loader's seed, rank and world size,
    and whether it was gathered from learnt keys (``guessed``) or planned."""

    epoch: int
    batch: int
    indices: np.ndarray
    seed: int
    rank: int
    world_size: int
    guessed: bool


class LoaderHook:
    """A base class for loader hooks: override either method (the defaults do nothing)."""

    def before_epoch(self, ctx: EpochContext) -> None:
        return None

    def after_assemble(self, batch: dict[str, Any], ctx: BatchContext) -> dict[str, Any]:
        return batch

    def before_plan(self, epoch: int, batch: int) -> None:
        return None
