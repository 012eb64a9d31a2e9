"""``MultimodalDataset``: the torch Dataset face of a :class:`~mmcache.sources.files.FileSource`.

A :class:`MultimodalDataset` is a file source (manifest records + a
:class:`~mmcache.pipeline.Pipeline`; keys, stamps, produce: see
:mod:`mmcache.sources.files`) that ``torch.utils.data`` can index: ``ds[i]`` is
``to_item(i, produce(i))``.

Bad samples under ``on_error="skip"``: ``ds[i]`` returns ``None`` for a sample
that cannot be produced, records it (id, path, reason) and goes on. The
:func:`collate` function of this module drops ``None`` entries, and
``mmcache.DataLoader`` does so itself; with a plain ``torch.utils.data.DataLoader``
pass ``collate_fn=mmcache.dataset.collate``. We chose dropping over substituting another
sample because substitution makes some samples appear twice per epoch, which
changes training results; a filtered index would need a full decode pass
before the first epoch. :meth:`~mmcache.sources.files.FileSource.rejects` lists the
skipped samples in the parent whatever process found them
(:mod:`mmcache.sources.rejects`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from mmcache.errors import ConfigError, SampleError
from mmcache.pipeline import Pipeline
from mmcache.sources.base import OnError, SampleSource
from mmcache.sources.files import FileSource, Sample, check_on_error
from mmcache.sources.open import OpenOptions, open_source, sniff_format, wrap_object
from mmcache.sources.records import Records
from mmcache.sources.rejects import Reject

__all__ = ["MultimodalDataset", "Reject", "Sample", "SourceDataset", "collate"]

#: The formats whose factory gives the Records of loose files (a FileSource's own).
_RECORD_FORMATS = ("jsonl", "llava", "coco")


def _is_records_location(manifest: object, format: str) -> bool:
    """Whether ``MultimodalDataset(manifest, format=format)`` is a FileSource of records."""
    if isinstance(manifest, Records):
        return True
    if not isinstance(manifest, str | os.PathLike):
        return False  # a source object (SampleSource, datasets.Dataset)
    return (sniff_format(manifest) if format == "auto" else format) in _RECORD_FORMATS


class MultimodalDataset(FileSource, torch.utils.data.Dataset[dict[str, Any] | None]):
    """Image-text samples from a manifest, decoded by a :class:`~mmcache.pipeline.Pipeline`.

    Examples:
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
        # A source object that is already a torch Dataset (a WebDatasetSource...) is
        # returned as it is; a Parquet file, an HF dataset, any other source object...:
        # a SourceDataset (the same face over any SampleSource). Subclasses and
        # unpickling (no arguments) get cls.
        manifest = args[0] if args else kwargs.get("manifest")
        if (
            cls is MultimodalDataset
            and not isinstance(manifest, (str, os.PathLike, Records, MultimodalDataset))
            and isinstance(manifest, SampleSource)
        ):
            pipeline = kwargs.get("pipeline")
            if pipeline is not None and pipeline.fingerprint() != manifest.fingerprint():
                raise ConfigError(
                    "MultimodalDataset(source, pipeline=...): the pipeline differs from "
                    "the source's own (it was made with another pipeline); give the "
                    "pipeline to the source"
                )
            if isinstance(manifest, torch.utils.data.Dataset):
                return manifest
        if (
            cls is MultimodalDataset
            and manifest is not None
            and not _is_records_location(manifest, kwargs.get("format", "auto"))
        ):
            return object.__new__(SourceDataset)
        made: MultimodalDataset = object.__new__(cls)
        return made

    def __init__(
        self,
        manifest: str | os.PathLike[str] | Records | Any,
        *,
        pipeline: Pipeline | None = None,
        on_error: OnError = "raise",
        content_stamp: bool = False,
        format: str = "auto",
        columns: Mapping[str, str | None] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        image_root: str | os.PathLike[str] | None = None,
    ) -> None:
        check_on_error(on_error)
        if not isinstance(pipeline, Pipeline):
            raise ConfigError(f"pipeline must be a mmcache.Pipeline, got {type(pipeline).__name__}")
        if columns is not None or storage_options is not None:
            raise ConfigError(
                "columns= and storage_options= are for Parquet, HF datasets and remote "
                "sources, not a manifest of local files"
            )
        if not isinstance(manifest, Records):
            root = None if image_root is None else os.fspath(image_root)
            options = OpenOptions(pipeline=pipeline, on_error=on_error, image_root=root)
            opened = open_source(manifest, format=format, options=options)
            if not isinstance(opened, Records):  # a subclass given a Parquet path...
                raise ConfigError(
                    f"{type(self).__name__} reads manifests of image files; for "
                    f"{manifest!r} use MultimodalDataset(...) (a SourceDataset)"
                )
            manifest = opened
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


class SourceDataset(MultimodalDataset):
    """:class:`MultimodalDataset` over any :class:`~mmcache.sources.base.SampleSource`: what
    ``MultimodalDataset(path)`` is for a Parquet file, a saved HF dataset, a COCO... source
    object or ``datasets.Dataset`` given in place of a path.

    Each member of the source protocol is the source's (:attr:`source`); ``ds[i]``, the
    skip policy and :func:`collate` are MultimodalDataset's. ``pipeline`` may be left out
    when a source object is given (it has its own; a different one is refused).
    """

    source: SampleSource

    def __init__(
        self,
        manifest: Any,
        *,
        pipeline: Pipeline | None = None,
        on_error: OnError = "raise",
        content_stamp: bool = False,
        format: str = "auto",
        columns: Mapping[str, str | None] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        image_root: str | os.PathLike[str] | None = None,
    ) -> None:
        check_on_error(on_error)
        if content_stamp:
            raise ConfigError("content_stamp=True is for manifests of loose image files")
        if pipeline is not None and not isinstance(pipeline, Pipeline):
            raise ConfigError(f"pipeline must be a mmcache.Pipeline, got {type(pipeline).__name__}")
        root = None if image_root is None else os.fspath(image_root)
        options = OpenOptions(
            pipeline=pipeline,
            on_error=on_error,
            columns=columns,
            storage_options=storage_options,
            image_root=root,
        )
        if isinstance(manifest, str | os.PathLike):
            if pipeline is None:
                raise ConfigError("pipeline must be a mmcache.Pipeline, got NoneType")
            opened = open_source(manifest, format=format, options=options)
            source = opened if isinstance(opened, SampleSource) else None
        else:
            if pipeline is None and type(manifest).__module__.split(".")[0] == "datasets":
                raise ConfigError("pipeline must be a mmcache.Pipeline, got NoneType")
            source = wrap_object(manifest, options)
        if source is None:
            raise ConfigError(
                "MultimodalDataset needs a manifest path, a data location (Parquet, COCO, a "
                f"saved HF dataset...), a datasets.Dataset or a SampleSource, got {manifest!r}"
            )
        own = getattr(source, "pipeline", None)
        if pipeline is not None and own is not None and own != pipeline:
            raise ConfigError("the source was made with another pipeline than pipeline=")
        self.source = source
        self.pipeline = cast(Pipeline, own if own is not None else pipeline)
        self.on_error = source.on_error
        self.stamp_kind = source.stamp_kind

    # Every member below is the source's: explicit, so the protocol stays checkable.
    def __len__(self) -> int:
        return len(self.source)

    def sample_id(self, index: int) -> str:
        return self.source.sample_id(index)

    def ids(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        return self.source.ids(indices)

    def ids_digest(self) -> str:
        return self.source.ids_digest()

    def fingerprint(self) -> str:
        return self.source.fingerprint()

    def describe(self) -> str:
        return self.source.describe()

    @property
    def varying_fields(self) -> frozenset[str]:
        return frozenset(getattr(self.source, "varying_fields", ()))

    @property
    def channels_last_fields(self) -> frozenset[str]:
        return frozenset(getattr(self.source, "channels_last_fields", ()))

    @property
    def pad_token_id(self) -> int | None:
        pad = getattr(self.source, "pad_token_id", None)
        return None if pad is None else int(pad)

    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.source.stamps(indices)

    def key_rows(
        self, indices: Sequence[int] | np.ndarray, *, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        return self.source.key_rows(indices, stamps=stamps)

    def key(self, index: int) -> bytes:
        return self.source.key(index)

    def keys(self, indices: Sequence[int] | np.ndarray) -> list[bytes]:
        rows = self.source.key_rows(indices)
        return [rows[j].tobytes() for j in range(rows.shape[0])]

    def produce(self, index: int) -> Sample:
        return self.source.produce(index)

    def to_item(self, index: int, sample: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return self.source.to_item(index, sample)

    def record_reject(self, err: Exception) -> None:
        self.source.record_reject(err)

    def rejects(self) -> list[Reject]:
        listed = getattr(self.source, "rejects", None)
        return list(listed()) if callable(listed) else []

    def __repr__(self) -> str:
        return f"MultimodalDataset({self.source!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()


def collate(batch: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """torch's default collate, after dropping ``None`` (skipped) samples.

    Use as ``torch.utils.data.DataLoader(ds, collate_fn=mmcache.dataset.collate)`` with
    ``on_error="skip"``. A batch whose samples were all skipped collates to ``{}``.
    """
    kept = [item for item in batch if item is not None]
    if not kept:
        return {}
    out: dict[str, Any] = torch.utils.data.default_collate(kept)
    return out
