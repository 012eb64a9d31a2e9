"""``MultimodalDataset``: the torch Dataset face of a :class:`~mmcache.sources.files.FileSource`.

A :class:`MultimodalDataset` is a file source (manifest records + a
:class:`~mmcache.pipeline.Pipeline`; keys, stamps, produce: see
:mod:`mmcache.sources.files`) that ``torch.utils.data`` can index: ``ds[i]`` is
``to_item(i, produce(i))``.

Bad samples under ``on_error="skip"``: ``ds[i]`` returns ``None`` for a sample
that cannot be produced, records it (id, path, reason) and goes on. The
:func:`collate` function of this module drops ``None`` entries, and
``mmcache.DataLoader`` does so itself; with a plain ``torch.utils.data.DataLoader``
pass ``collate_fn=mmcache.collate``. We chose dropping over substituting another
sample because substitution makes some samples appear twice per epoch, which
changes training results; a filtered index would need a full decode pass
before the first epoch. :meth:`~mmcache.sources.files.FileSource.rejects` lists the
skipped samples in the parent whatever process found them
(:mod:`mmcache.sources.rejects`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mmcache.errors import ConfigError, SampleError
from mmcache.pipeline import Pipeline
from mmcache.sources.base import OnError, SampleSource
from mmcache.sources.files import FileSource, Sample, check_on_error
from mmcache.sources.records import Records
from mmcache.sources.rejects import Reject

__all__ = ["MultimodalDataset", "Reject", "Sample", "collate"]


class MultimodalDataset(FileSource, torch.utils.data.Dataset[dict[str, Any] | None]):
    """Image-text samples from a manifest, decoded by a :class:`~mmcache.pipeline.Pipeline`.

    >>> ds = MultimodalDataset("train.jsonl", pipeline=pipe)      # doctest: +SKIP
    >>> ds[0]["image"].shape                                        # doctest: +SKIP
    torch.Size([3, 224, 224])

    Args:
        manifest: a seed JSONL or LLaVA JSON manifest path, or :class:`Records`.
        pipeline: how to turn a record into arrays.
        on_error: ``"raise"`` (default) raises :class:`SampleError` naming the id,
            the path and the reason; ``"skip"`` returns ``None`` for the sample,
            counts and lists it (see the module docstring).
        content_stamp: key samples by a hash of the image bytes instead of the
            file's ``stat`` stamp (size, mtime, ctime, inode: see
            :data:`mmcache.keys.STAT_FIELDS`); slower: reads every file to compute
            a key; for file systems whose ctimes or inode numbers are not
            trustworthy.

    A :class:`~mmcache.sources.base.SampleSource` (see
    :class:`~mmcache.sources.files.FileSource` for its members).
    """

    pipeline: Pipeline

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """``MultimodalDataset(source)`` with a source object (a ``WebDatasetSource``...)
        returns that source as it is (each is a torch Dataset); a manifest makes a new one."""
        first = args[0] if args else kwargs.get("manifest")
        if not isinstance(first, (str, os.PathLike, Records)) and isinstance(first, SampleSource):
            pipeline = kwargs.get("pipeline")
            if pipeline is not None and pipeline.fingerprint() != first.fingerprint():
                raise ConfigError(
                    "MultimodalDataset(source, pipeline=...): the pipeline differs from "
                    "the source's own; give it to the source"
                )
            return first
        return super().__new__(cls)

    def __init__(
        self,
        manifest: str | os.PathLike[str] | Records,
        *,
        pipeline: Pipeline,
        on_error: OnError = "raise",
        content_stamp: bool = False,
    ) -> None:
        check_on_error(on_error)
        if not isinstance(pipeline, Pipeline):
            raise ConfigError(f"pipeline must be a mmcache.Pipeline, got {type(pipeline).__name__}")
        super().__init__(
            manifest, pipeline=pipeline, on_error=on_error, content_stamp=content_stamp
        )

    def stat_stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The old name of :meth:`~mmcache.sources.files.FileSource.stamps`."""
        return self.stamps(indices)

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        try:
            sample = self.produce(index)
        except SampleError as err:
            if self.on_error == "raise":
                raise
            self.record_reject(err)
            return None
        return self.to_item(index, sample)


def collate(batch: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """torch's default collate, after dropping ``None`` (skipped) samples.

    Use as ``torch.utils.data.DataLoader(ds, collate_fn=mmcache.collate)`` with
    ``on_error="skip"``. A batch whose samples were all skipped collates to ``{}``.
    """
    kept = [item for item in batch if item is not None]
    if not kept:
        return {}
    out: dict[str, Any] = torch.utils.data.default_collate(kept)
    return out
