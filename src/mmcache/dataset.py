"""The torch Dataset faces of sources, and :func:`open_source`, the factory that picks one.

:func:`open_source` turns a location (a manifest, a Parquet file or folder, a saved HF
dataset, COCO, WebDataset shards; the registry of :mod:`mmcache.sources.open`) or an
object (a ``datasets.Dataset``, any :class:`~mmcache.sources.base.SampleSource`) into a
source that ``torch.utils.data`` can index:

- a manifest of loose files: a :class:`MultimodalDataset` (a
  :class:`~mmcache.sources.files.FileSource`: keys, stamps, produce, see
  :mod:`mmcache.sources.files`);
- a source that is already a torch ``Dataset`` (a ``WebDatasetSource``): itself;
- any other source: a :class:`SourceDataset`, the plain torch face over it.

``ds[i]`` is ``to_item(i, produce(i))`` (:func:`mmcache.sources.items.serve`).
``MultimodalDataset(location, ...)`` is a thin call into :func:`open_source`.

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
from typing import Any

import numpy as np
import torch

from mmcache.errors import ConfigError
from mmcache.pipeline import Pipeline
from mmcache.sources import open as _open
from mmcache.sources.base import OnError, SampleSource
from mmcache.sources.capabilities import CAPABILITIES, members_of
from mmcache.sources.files import FileSource, Sample, check_on_error
from mmcache.sources.freshness import Freshness
from mmcache.sources.items import serve
from mmcache.sources.records import Records
from mmcache.sources.rejects import Reject

__all__ = ["MultimodalDataset", "Reject", "Sample", "SourceDataset", "collate", "open_source"]

#: The formats whose factory gives the Records of loose files (a FileSource's own).
_RECORD_FORMATS = ("jsonl", "llava", "coco")


def _is_records_location(manifest: object, format: str) -> bool:
    """Whether ``manifest`` (with ``format``) is read as a FileSource of records."""
    if isinstance(manifest, Records):
        return True
    if not isinstance(manifest, str | os.PathLike):
        return False  # a source object (SampleSource, datasets.Dataset)
    return (_open.sniff_format(manifest) if format == "auto" else format) in _RECORD_FORMATS


def _refuse_table_options(options: Mapping[str, Any]) -> None:
    """ConfigError when ``columns=`` or ``storage_options=`` is given for a manifest of
    loose files (they are a table's and a remote store's options)."""
    if any(options.get(name) is not None for name in ("columns", "storage_options")):
        raise ConfigError(
            "columns= and storage_options= are for Parquet, HF datasets and remote "
            "sources, not a manifest of local files"
        )


def open_source(
    location: str | os.PathLike[str] | Records | Any,
    *,
    pipeline: Pipeline | None = None,
    format: str = "auto",
    columns: Mapping[str, str | None] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    image_root: str | os.PathLike[str] | None = None,
    on_error: OnError = "raise",
    content_stamp: bool = False,
    freshness: Freshness = "epoch",
    recheck: float = 0.0,
) -> Any:
    """The source of ``location``, as a torch ``Dataset`` (see the module docstring).

    >>> ds = mmcache.open_source("a.parquet", pipeline=pipe, columns={"id": "k"})  # doctest: +SKIP

    Args:
        location: a manifest path (JSONL, LLaVA), :class:`Records`, a Parquet file, glob,
            URL or folder, a saved HF dataset folder, a COCO annotation file, WebDataset
            shards (a path, brace pattern or URL), a ``datasets.Dataset``, or a
            :class:`~mmcache.sources.base.SampleSource`.
        pipeline: how samples are made (required but for a source object, which has its
            own; a different one is refused).
        format: ``"auto"`` (sniffed) or a name of
            :func:`~mmcache.sources.open.source_format_names`.
        columns: the ``id``/``image``/``text`` column names (Parquet, HF datasets).
        storage_options: for fsspec URLs (Parquet, WebDataset).
        image_root: the images' folder (COCO).
        on_error: ``"raise"`` or ``"skip"`` (see :class:`MultimodalDataset`).
        content_stamp: key loose files by their bytes always (manifests of loose files).
        freshness, recheck: how often loose files are ``stat``-ed again (manifests of
            loose files; see :class:`MultimodalDataset`).

    Returns a :class:`MultimodalDataset`, the source itself, or a :class:`SourceDataset`.
    ConfigError for an option the location's kind does not take, naming it.
    """
    on_error = check_on_error(on_error)
    if pipeline is not None and not isinstance(pipeline, Pipeline):
        raise ConfigError(f"pipeline must be a mmcache.Pipeline, got {type(pipeline).__name__}")
    if _is_records_location(location, format):
        _refuse_table_options({"columns": columns, "storage_options": storage_options})
        return MultimodalDataset(
            location,
            pipeline=pipeline,
            on_error=on_error,
            content_stamp=content_stamp,
            freshness=freshness,
            recheck=recheck,
            format=format,
            image_root=image_root,
        )
    if content_stamp:
        raise ConfigError("content_stamp=True is for manifests of loose image files")
    if freshness != "epoch" or recheck:
        raise ConfigError(
            f"freshness={freshness!r} and recheck={recheck!r} are for manifests of loose "
            "image files (a table's or shard's stamps are taken when it is opened)"
        )
    root = None if image_root is None else os.fspath(image_root)
    options = _open.OpenOptions(
        pipeline=pipeline,
        on_error=on_error,
        columns=columns,
        storage_options=storage_options,
        image_root=root,
    )
    source: SampleSource | None
    if isinstance(location, str | os.PathLike):
        if pipeline is None:
            raise ConfigError("pipeline must be a mmcache.Pipeline, got NoneType")
        opened = _open.open_source(location, format=format, options=options)
        source = opened if isinstance(opened, SampleSource) else None
    else:
        if pipeline is None and type(location).__module__.split(".")[0] == "datasets":
            raise ConfigError("pipeline must be a mmcache.Pipeline, got NoneType")
        source = _open.wrap_object(location, options)
    if source is None:
        raise ConfigError(
            "open_source needs a manifest path, a data location (Parquet, COCO, a saved HF "
            f"dataset...), a datasets.Dataset or a SampleSource, got {location!r}"
        )
    if pipeline is not None and pipeline.fingerprint() != source.fingerprint():
        raise ConfigError(
            "pipeline=: the pipeline differs from the source's own (the source was made "
            "with another pipeline); give the pipeline to the source"
        )
    if isinstance(source, torch.utils.data.Dataset) and not isinstance(source, FileSource):
        return source
    return SourceDataset(source)


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
        freshness: ``"epoch"`` (default: every file is ``stat``-ed again at every check,
            each epoch) or ``"run"`` (once per run and process: for data that does not
            change while the job runs; a file rewritten meanwhile is not seen).
        recheck: with ``"epoch"``, seconds a file found unchanged is trusted without a new
            ``stat`` (default 0). A rewrite is seen at most that long after. For network
            file systems (~0.5 ms a ``stat``); see :mod:`mmcache.sources.freshness`.
        format, image_root: as :func:`open_source` takes them (a COCO file's images).

    ``MultimodalDataset(location, ...)`` of any other location or object is
    :func:`open_source`'s answer (a :class:`SourceDataset`, or the source itself).
    A :class:`~mmcache.sources.base.SampleSource` (see
    :class:`~mmcache.sources.files.FileSource` for its members).
    """

    pipeline: Pipeline

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A thin call into open_source for anything but a manifest of loose files (what is
        # returned is then no MultimodalDataset, so Python does not run __init__ on it).
        # Subclasses and unpickling (no arguments) get cls.
        manifest = args[0] if args else kwargs.get("manifest")
        if cls is MultimodalDataset and manifest is not None:
            if isinstance(manifest, MultimodalDataset):
                return SourceDataset(manifest)
            if not _is_records_location(manifest, kwargs.get("format", "auto")):
                rest = {k: v for k, v in kwargs.items() if k != "manifest"}
                return open_source(manifest, *args[1:], **rest)
            _refuse_table_options(kwargs)
        made: MultimodalDataset = object.__new__(cls)
        return made

    def __init__(
        self,
        manifest: str | os.PathLike[str] | Records | Any,
        *,
        pipeline: Pipeline | None = None,
        on_error: OnError = "raise",
        content_stamp: bool = False,
        freshness: Freshness = "epoch",
        recheck: float = 0.0,
        format: str = "auto",
        image_root: str | os.PathLike[str] | None = None,
    ) -> None:
        check_on_error(on_error)
        if not isinstance(pipeline, Pipeline):
            raise ConfigError(f"pipeline must be a mmcache.Pipeline, got {type(pipeline).__name__}")
        if not isinstance(manifest, Records):
            root = None if image_root is None else os.fspath(image_root)
            options = _open.OpenOptions(pipeline=pipeline, on_error=on_error, image_root=root)
            opened = _open.open_source(manifest, format=format, options=options)
            if not isinstance(opened, Records):  # a subclass given a Parquet path...
                raise ConfigError(
                    f"{type(self).__name__} reads manifests of image files; for "
                    f"{manifest!r} use mmcache.open_source(...)"
                )
            manifest = opened
        super().__init__(
            manifest,
            pipeline=pipeline,
            on_error=on_error,
            content_stamp=content_stamp,
            freshness=freshness,
            recheck=recheck,
        )


#: The members a :class:`SourceDataset` forwards when, and only when, its source has them:
#: every capability's (:mod:`mmcache.sources.capabilities`), so that the face claims a
#: capability exactly when the source does.
_FORWARDED = frozenset(m for cap in CAPABILITIES for m in members_of(cap))


class SourceDataset(torch.utils.data.Dataset[dict[str, Any] | None]):
    """The torch Dataset face of any :class:`~mmcache.sources.base.SampleSource`: what
    :func:`open_source` gives for a Parquet file, a saved HF dataset, a COCO... source
    object or ``datasets.Dataset``.

    Each member of the source protocol is the source's (:attr:`source`); ``ds[i]`` is
    :func:`~mmcache.sources.items.serve` (the skip policy of :class:`MultimodalDataset`).
    The members of a capability (:mod:`mmcache.sources.capabilities`: ``lengths``,
    ``varying_fields``, ``revalidate``, ``rejects``...) are forwarded when the source
    has them, so ``isinstance(ds, HasLengths)`` is the source's answer. Pickles as its
    source; thread/process safety is the source's.
    """

    def __init__(self, source: SampleSource) -> None:
        if not isinstance(source, SampleSource):
            raise ConfigError(
                f"SourceDataset needs a SampleSource, got {type(source).__name__} "
                "(mmcache.open_source makes one of a location)"
            )
        self.source = source
        self.pipeline = getattr(source, "pipeline", None)  # optional: not in the protocol
        self.on_error: OnError = source.on_error
        self.stamp_kind = source.stamp_kind

    def __getattr__(self, name: str) -> Any:
        # Only for what the instance and the class lack: a capability's member, if the
        # source has it (never during unpickling, when there is no source yet).
        source = self.__dict__.get("source")
        if name not in _FORWARDED or source is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(source, name)

    # The protocol's members: explicit, so the protocol stays checkable.
    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        return serve(self, index)

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

    def __repr__(self) -> str:
        return f"SourceDataset({self.source!r})"


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
