"""Which source reads a path or URL: the registry of data formats behind
``mmcache.open_source(path)`` (:func:`register_source_format`, :func:`open_source`).

A format has a name (what ``format=`` takes), a *sniff* (does this location
look like it?) and a *factory* (location + :class:`OpenOptions` -> a
:class:`~mmcache.sources.base.SampleSource`, or the
:class:`~mmcache.sources.records.Records` of a manifest of loose files, which
``MultimodalDataset`` reads as before). With ``format="auto"`` the sniffs are
asked in registration order and the first yes wins; when none says yes the
location is a JSONL or LLaVA manifest (:func:`~mmcache.sources.readers.read_manifest`'s
own sniff, the behaviour from before this registry).

Built in: ``"parquet"`` (a ``.parquet``/``.pq`` file, a glob or URL of them, a folder
holding them, or a file starting with ``PAR1``), ``"hf"`` (a folder written by
``datasets.Dataset.save_to_disk``), ``"coco"`` (a ``.json`` object with ``images``
and ``annotations``), ``"llava"`` and ``"jsonl"`` (named only with ``format=``). Other
modules register theirs at import (a WebDataset source: ``"wds"``).

Thread safety: the registry is a plain dict written at import time; sniffs and
factories are called from the constructing thread only.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmcache.errors import ConfigError
from mmcache.sources.base import OnError, SampleSource
from mmcache.sources.records import Records

if TYPE_CHECKING:
    from mmcache.transforms.pipeline import StagedProcessor

__all__ = [
    "OpenOptions",
    "Sniff",
    "SourceFactory",
    "check_format",
    "open_source",
    "register_source_format",
    "sniff_format",
    "source_format_names",
    "wrap_object",
]

#: Bytes of a local file handed to the sniffs.
HEAD_BYTES = 4096


@dataclass(frozen=True)
class OpenOptions:
    """What ``MultimodalDataset`` passes a factory (``None``: the format's default).

    ``columns``: names of the ``id``/``image``/``text`` columns (Parquet, HF);
    ``storage_options``: for object store URLs; ``image_root``: the images' folder (COCO).
    """

    pipeline: Any
    on_error: OnError = "raise"
    columns: Mapping[str, str | None] | None = None
    storage_options: Mapping[str, Any] | None = None
    image_root: str | None = None


#: ``sniff(location, head) -> bool``: ``location`` as given (a path, a glob, a URL, a
#: brace pattern); ``head``: the first :data:`HEAD_BYTES` bytes when it is a local
#: file, else ``b""`` (remote objects are not read to sniff them).
Sniff = Callable[[str, bytes], bool]
#: ``factory(location, options) -> SampleSource`` (or Records, for a manifest of files).
SourceFactory = Callable[[str, OpenOptions], "SampleSource | Records"]


@dataclass(frozen=True)
class _Format:
    sniff: Sniff
    factory: SourceFactory


_FORMATS: dict[str, _Format] = {}


def register_source_format(name: str, sniff: Sniff, factory: SourceFactory) -> None:
    """Make ``factory`` the reader of ``mmcache.open_source(location, format=name)`` and of
    the locations ``sniff`` recognises under ``format="auto"`` (asked after the formats
    registered before it). Call at import time. ConfigError for a name already
    registered, ``"auto"``, or arguments that are not callable.

    >>> register_source_format("parquet", lambda loc, head: False, lambda loc, o: None)
    Traceback (most recent call last):
    ...
    mmcache.errors.ConfigError: source format 'parquet' is already registered
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ConfigError(f"a source format needs a name other than 'auto', got {name!r}")
    if name in _FORMATS:
        raise ConfigError(f"source format {name!r} is already registered")
    if not callable(sniff) or not callable(factory):
        raise ConfigError(f"source format {name!r}: sniff and factory must be callable")
    _FORMATS[name] = _Format(sniff, factory)


def source_format_names() -> list[str]:
    """Registered formats, in the order ``format="auto"`` asks them."""
    return list(_FORMATS)


def _head(location: str) -> bytes:
    if "://" in location or not os.path.isfile(location):
        return b""
    try:
        with open(location, "rb") as f:
            return f.read(HEAD_BYTES)
    except OSError:
        return b""  # the factory reports it


def sniff_format(location: str | os.PathLike[str]) -> str:
    """The format ``format="auto"`` picks for ``location`` (``"jsonl"`` when no sniff
    says yes: a JSONL or LLaVA manifest, told apart by its first byte)."""
    name = os.fspath(location)
    if not isinstance(name, str):
        raise ConfigError(f"a location must be a str or os.PathLike[str], got {name!r}")
    head = _head(name)
    for fmt, entry in _FORMATS.items():
        if entry.sniff(name, head):
            return fmt
    return "llava" if head.lstrip(b"\xef\xbb\xbf").lstrip().startswith(b"[") else "jsonl"


def check_format(format: str) -> str:
    """``format`` when it is ``"auto"`` or a registered name; ConfigError naming the
    registered names otherwise."""
    if format != "auto" and format not in _FORMATS:
        raise ConfigError(f"format must be 'auto' or one of {', '.join(_FORMATS)}, got {format!r}")
    return format


def open_source(
    location: str | os.PathLike[str], *, format: str = "auto", options: OpenOptions
) -> SampleSource | Records:
    """The source (or the Records of a manifest) that ``format`` (or the sniffed one)
    makes of ``location``. ConfigError for an unknown format."""
    name = os.fspath(location)
    if not isinstance(name, str):
        raise ConfigError(f"a location must be a str or os.PathLike[str], got {name!r}")
    if format == "auto":
        format = sniff_format(name)
        if format in ("jsonl", "llava"):  # no sniff said yes: a manifest, read as before
            from mmcache.sources.readers import read_manifest

            return read_manifest(name, on_error=options.on_error)
    return _FORMATS[check_format(format)].factory(name, options)


def wrap_object(obj: object, options: OpenOptions) -> SampleSource | None:
    """A source for an object given in place of a path: itself if it is a
    :class:`SampleSource`, an :class:`~mmcache.sources.hfdataset.HFDatasetSource`
    for a ``datasets.Dataset``; None otherwise."""
    if isinstance(obj, SampleSource):
        return obj
    if type(obj).__module__.split(".")[0] == "datasets":
        from mmcache.sources.hfdataset import HFDatasetSource

        return HFDatasetSource(
            obj, pipeline=options.pipeline, columns=options.columns, on_error=options.on_error
        )
    return None


# -- built-in formats ---------------------------------------------------------------------
_PARQUET_EXT = (".parquet", ".pq")


def _sniff_parquet(location: str, head: bytes) -> bool:
    if head.startswith(b"PAR1"):
        return True
    if location.lower().endswith(_PARQUET_EXT):
        return True
    if "://" not in location and os.path.isdir(location):
        return bool(glob.glob(os.path.join(location, "**", "*.parquet"), recursive=True))
    return False


def _open_parquet(location: str, options: OpenOptions) -> SampleSource:
    from mmcache.sources.parquet import ParquetSource

    return ParquetSource(
        location,
        pipeline=_staged(options.pipeline),
        columns=options.columns,
        on_error=options.on_error,
        storage_options=options.storage_options,
    )


def _sniff_hf(location: str, head: bytes) -> bool:
    return (
        "://" not in location
        and os.path.isfile(os.path.join(location, "state.json"))
        and os.path.isfile(os.path.join(location, "dataset_info.json"))
    )


def _open_hf(location: str, options: OpenOptions) -> SampleSource:
    from mmcache.sources.hfdataset import HFDatasetSource, _datasets

    dataset = _datasets().load_from_disk(location)
    return HFDatasetSource(
        dataset,
        pipeline=_staged(options.pipeline),
        columns=options.columns,
        on_error=options.on_error,
    )


def _sniff_coco(location: str, head: bytes) -> bool:
    from mmcache.sources.coco import looks_like_coco

    return location.lower().endswith(".json") and looks_like_coco(head)


def _open_coco(location: str, options: OpenOptions) -> Records:
    from mmcache.sources.coco import read_coco

    return read_coco(location, image_root=options.image_root, on_error=options.on_error)


def _manifest_reader(fmt: str) -> SourceFactory:
    def open_manifest(location: str, options: OpenOptions) -> Records:
        from mmcache.sources.readers import read_manifest

        return read_manifest(location, on_error=options.on_error, format=fmt)

    return open_manifest


def _staged(pipeline: Any) -> StagedProcessor:
    staged: StagedProcessor = pipeline  # checked by the source (stages + fingerprint)
    return staged


def _sniff_wds(location: str, head: bytes) -> bool:
    from mmcache.sources.wds import sniff

    return sniff(location)


def _open_wds(location: str, options: OpenOptions) -> SampleSource:
    from mmcache.sources.wds import WebDatasetSource

    return WebDatasetSource(
        location,
        pipeline=options.pipeline,
        on_error=options.on_error,
        storage_options=options.storage_options,
    )


def _never(location: str, head: bytes) -> bool:
    return False


register_source_format("parquet", _sniff_parquet, _open_parquet)
register_source_format("hf", _sniff_hf, _open_hf)
register_source_format("coco", _sniff_coco, _open_coco)
register_source_format("wds", _sniff_wds, _open_wds)
register_source_format("llava", _never, _manifest_reader("llava"))
register_source_format("jsonl", _never, _manifest_reader("jsonl"))
