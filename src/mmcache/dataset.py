""":class:`MultimodalDataset`, the source of a manifest of loose files, and
:func:`open_source`, the factory that opens any location as its source.

:func:`open_source` turns a location (a manifest, a Parquet file or folder, a saved HF
dataset, COCO, WebDataset shards; the registry of :mod:`mmcache.sources.open`) or an
object (a ``datasets.Dataset``, any :class:`~mmcache.sources.base.SampleSource`) into
its source: a :class:`MultimodalDataset` for a manifest of loose files (a
:class:`~mmcache.sources.files.FileSource`: keys, stamps, produce, see
:mod:`mmcache.sources.files`), the format's source for any other location, and a source
object itself. Every built-in source is a torch ``Dataset``
(:class:`~mmcache.sources.chassis.BaseSource`): ``ds[i]`` is ``to_item(i, produce(i))``
(:func:`mmcache.sources.items.serve`). ``MultimodalDataset(location, ...)`` takes a
manifest (JSONL, LLaVA, COCO) and names :func:`open_source` for any other location.

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

import torch

from mmcache.errors import ConfigError
from mmcache.sources import open as _open
from mmcache.sources.base import OnError, SampleSource
from mmcache.sources.files import FileSource, Sample, check_on_error
from mmcache.sources.freshness import Freshness
from mmcache.sources.records import Records
from mmcache.sources.rejects import Reject
from mmcache.transforms.pipeline import Pipeline

__all__ = ["MultimodalDataset", "Reject", "Sample", "collate", "open_source"]

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
    """ConfigError when ``columns=`` is given for a manifest of loose files (a table's
    option; ``storage_options=`` is taken: a manifest may name objects)."""
    if options.get("columns") is not None:
        raise ConfigError("columns= is for Parquet and HF datasets, not a manifest of image files")


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
) -> SampleSource:
    """The source of ``location`` (see the module docstring).

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
        storage_options: for object store URLs (Parquet, WebDataset, a manifest's
            images or clips).
        image_root: the images' folder (COCO).
        on_error: ``"raise"`` or ``"skip"`` (see :class:`MultimodalDataset`).
        content_stamp: key loose files by their bytes always (manifests of loose files).
        freshness, recheck: how often loose files are ``stat``-ed again (manifests of
            loose files; see :class:`MultimodalDataset`).

    Returns a :class:`MultimodalDataset`, the format's source, or the source object
    itself. ConfigError for an option the location's kind does not take, naming it.
    """
    on_error = check_on_error(on_error)
    if pipeline is not None and not isinstance(pipeline, Pipeline):
        raise ConfigError(f"pipeline must be a mmcache.Pipeline, got {type(pipeline).__name__}")
    if _is_records_location(location, format):
        _refuse_table_options({"columns": columns})
        return MultimodalDataset(
            location,
            pipeline=pipeline,
            on_error=on_error,
            content_stamp=content_stamp,
            freshness=freshness,
            recheck=recheck,
            format=format,
            image_root=image_root,
            storage_options=storage_options,
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
    return source


class MultimodalDataset(FileSource):
    """Image-text samples from a manifest, decoded by a :class:`~mmcache.Pipeline`.

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
        storage_options: the object store's options when the manifest names URLs (the
            images or clips are then objects: :class:`~mmcache.sources.files.FileSource`).

    Any other location (Parquet, WebDataset shards, a saved HF dataset) or a source
    object is :func:`open_source`'s: a ConfigError here names it. A
    :class:`~mmcache.sources.base.SampleSource` and a torch ``Dataset`` (see
    :class:`~mmcache.sources.files.FileSource` for its members).
    """

    pipeline: Pipeline

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
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        check_on_error(on_error)
        if not _is_records_location(manifest, _open.check_format(format)):
            what = (
                repr(os.fspath(manifest))
                if isinstance(manifest, str | os.PathLike)
                else f"a {type(manifest).__name__}"
            )
            raise ConfigError(
                f"{type(self).__name__} reads manifests of image files (JSONL, LLaVA, COCO); "
                f"for {what} use mmcache.open_source(...), which opens every location and "
                "source object"
            )
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
            storage_options=storage_options,
            freshness=freshness,
            recheck=recheck,
        )


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
