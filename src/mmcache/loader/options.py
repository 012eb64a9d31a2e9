"""The loader's grouped options: each a frozen dataclass, checked when it is made.

Options that only mean something together are one object, as :class:`PackSpec`
already was:

- :class:`SFTBatching`: how SFT batches (varying ``input_ids`` and ``labels``)
  are padded, grouped or packed: ``DataLoader(batching=SFTBatching(...))``.
- :class:`Augment`: the random transform after the cache and the device it runs
  on: ``DataLoader(augment=Augment(fn, device="cuda"))`` (a plain callable still
  means ``Augment(fn)``, on the CPU).
- :class:`Distributed`: this process's part of the epoch:
  ``DataLoader(distributed=Distributed(rank=0, world_size=8, drop_last=True))``
  (default: torch.distributed's rank and world size, padded parts).

Immutable, so safe to share between loaders and threads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmcache.errors import ConfigError
from mmcache.loader.packing import PackSpec
from mmcache.loader.padding import check_pad_config

__all__ = ["Augment", "Distributed", "SFTBatching", "loader_options"]


@dataclass(frozen=True)
class SFTBatching:
    """How a loader batches SFT samples (a source with varying ``input_ids`` and ``labels``).

    Args:
        pad_token_id: the id rows are padded with to the longest row of the batch;
            None: the source's (its tokenizer's), else 0.
        pad_to_multiple_of: the padded length is a multiple of it (8: tensor cores).
        group_by_length: batches of samples of similar length and the same modality
            (less padding; see :mod:`mmcache.loader.grouping`).
        pack: a :class:`PackSpec`: each batch is one pack of whole samples
            (``batch_size=1``; see :mod:`mmcache.loader.packing`); exclusive with
            ``group_by_length``.
    """

    pad_token_id: int | None = None
    pad_to_multiple_of: int = 8
    group_by_length: bool = False
    pack: PackSpec | None = None

    def __post_init__(self) -> None:
        check_pad_config(
            0 if self.pad_token_id is None else self.pad_token_id, self.pad_to_multiple_of
        )
        if not isinstance(self.group_by_length, bool):
            raise ConfigError(
                f"group_by_length must be True or False, got {self.group_by_length!r}"
            )
        if self.pack is not None and not isinstance(self.pack, PackSpec):
            raise ConfigError(f"pack must be a PackSpec or None, got {type(self.pack).__name__}")
        if self.pack is not None and self.group_by_length:
            raise ConfigError("pack= and group_by_length=True are exclusive: a pack is one batch")


@dataclass(frozen=True)
class Augment:
    """A random transform of each batch's images after the cache, and where it runs.

    ``fn``: an :mod:`mmcache.augment` transform
    (``Compose([RandomResizedCrop(224), RandomHorizontalFlip()])``) or any callable
    ``(images, generator) -> images``, seeded by ``(seed, epoch, sample index)``
    only (see :mod:`mmcache.loader.augmenting`). ``device``: where it runs
    (``"cuda"``: the batch's ``"image"`` is moved there first); None: the CPU.
    """

    fn: Callable[..., Any]
    device: str | torch.device | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ConfigError(
                f"augment must be callable (an mmcache.augment transform, or a function "
                f"(images, generator) -> images), got {type(self.fn).__name__}"
            )


@dataclass(frozen=True)
class Distributed:
    """This process's part of each epoch's order (see :mod:`mmcache.sampler`).

    Args:
        rank, world_size: default to torch.distributed's when it is initialised,
            else a single process; one without the other is refused unless
            torch.distributed is initialised.
        drop_last: how ranks get equal parts when the dataset does not divide by
            ``world_size``, as ``DistributedSampler``'s ``drop_last``: False pads
            by repeating the epoch's first samples (every sample is seen, a few
            twice), True drops the last few samples of the epoch's order. A torch
            ``DataLoader(sampler=DistributedSampler(ds, drop_last=a), drop_last=b)``
            has the batch counts of ``distributed=Distributed(drop_last=a),
            drop_last=b``.
    """

    rank: int | None = None
    world_size: int | None = None
    drop_last: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.drop_last, bool):
            raise ConfigError(
                f"Distributed.drop_last must be True or False, got {self.drop_last!r}"
            )


def loader_options(
    *,
    batching: SFTBatching | None,
    augment: Augment | Callable[..., Any] | None,
    distributed: Distributed | None,
) -> tuple[SFTBatching, Augment | None, Distributed]:
    """The loader's option objects as given, checked, with None as the defaults and a
    plain callable as ``Augment(fn)`` (on the CPU). ConfigError for a value of another type.
    """
    for arg, value, cls in (
        ("batching", batching, SFTBatching),
        ("distributed", distributed, Distributed),
    ):
        if value is not None and not isinstance(value, cls):
            raise ConfigError(f"{arg} must be a {cls.__name__} or None, got {type(value).__name__}")
    spec = augment if augment is None or isinstance(augment, Augment) else Augment(augment)
    return (
        SFTBatching() if batching is None else batching,
        spec,
        Distributed() if distributed is None else distributed,
    )
