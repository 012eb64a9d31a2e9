"""Which batches a loader makes: plain, grouped by length, or packed, and the SFT collate.

:func:`plan_batching` turns the ``DataLoader``'s batching options into the
:class:`~mmcache.loader.stream.BatchOrder` every part of the loader asks for its
batches (the training process, the miss workers' task sampler, the guessed warm
epochs and the stat prefetcher) and the hook that makes SFT batches of them
(:mod:`mmcache.loader.padding`). Grouping and packing only change the lists of
sample indices of each batch; nothing below the order knows about them.

Thread/process safety: pure (called once, when the loader is made).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmcache.errors import ConfigError, SampleError
from mmcache.hooks import LoaderHook
from mmcache.loader.grouping import LengthGroupedOrder
from mmcache.loader.lengths import sample_has_image, sample_lengths
from mmcache.loader.options import SFTBatching
from mmcache.loader.packing import PackedOrder
from mmcache.loader.padding import PackHook, PadHook, check_pad_config
from mmcache.loader.stream import BatchOrder
from mmcache.loader.varying import varying_fields
from mmcache.sampler import EpochSampler
from mmcache.sources.base import SampleSource
from mmcache.sources.capabilities import layout_of

__all__ = ["Batching", "plan_batching"]


@dataclass(frozen=True)
class Batching:
    """The order of the batches, the SFT hook (None: the source's batches as they are)
    and ``name``: what a resumed state must agree on."""

    order: BatchOrder
    hook: LoaderHook | None
    name: str


def plan_batching(
    source: SampleSource,
    sampler: EpochSampler,
    *,
    batch_size: int,
    drop_last: bool,
    options: SFTBatching,
) -> Batching:
    """The batching of a loader over ``source`` (ConfigError for options that do not fit;
    ``options`` checked its own fields when it was made)."""
    group_by_length, pack = options.group_by_length, options.pack
    pad_token_id, pad_to_multiple_of = options.pad_token_id, options.pad_to_multiple_of
    sft = {"input_ids", "labels"} <= varying_fields(source)
    if pad_token_id is None:
        pad_token_id = layout_of(source).pad_token_id
        pad_token_id = 0 if pad_token_id is None else pad_token_id
    check_pad_config(pad_token_id, pad_to_multiple_of)
    if pack is not None:
        if not sft:
            raise ConfigError(
                "pack= needs SFT samples: a source whose varying_fields include "
                "'input_ids' and 'labels' (variable-length token ids and labels)"
            )
        if batch_size != 1:
            raise ConfigError(
                f"with pack=, each batch is one pack of up to {pack.max_tokens} tokens: "
                f"pass batch_size=1 (got {batch_size}); raise max_tokens for bigger batches"
            )
        lengths = sample_lengths(source, why="pack=")
        too = np.flatnonzero(lengths > pack.max_tokens)
        if len(too):
            i = int(too[0])
            raise SampleError(
                f"{int(lengths[i])} tokens, more than PackSpec(max_tokens={pack.max_tokens}) "
                f"({len(too)} such samples): raise max_tokens or truncate (max_length)",
                sample_id=source.sample_id(i),
            )
        order: BatchOrder = PackedOrder(sampler, 1, False, lengths=lengths, spec=pack)
        hook = PackHook(source, lengths=lengths)
        return Batching(order, hook, pack.describe())
    pad = (
        PadHook(source, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of)
        if sft
        else None
    )
    if group_by_length:
        lengths = sample_lengths(source, why="group_by_length=True")
        has_image = sample_has_image(source)
        order = LengthGroupedOrder(
            sampler, batch_size, drop_last, lengths=lengths, has_image=has_image
        )
        return Batching(order, pad, "group_by_length")
    return Batching(BatchOrder(sampler, batch_size, drop_last), pad, "plain")
