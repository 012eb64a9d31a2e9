"""Sample sources: where samples come from (the protocol is in :mod:`mmcache.sources.base`).

:class:`FileSource` (:mod:`~mmcache.sources.files`) is the source of manifest
records with one image file each; the records are read by
:mod:`~mmcache.sources.readers` (a registry of manifest formats) into the
columnar :class:`Records` of :mod:`~mmcache.sources.records`; skipped samples
go to the process-shared log of :mod:`~mmcache.sources.rejects`.

Data read in place: :class:`ParquetSource` (:mod:`~mmcache.sources.parquet`),
:class:`HFDatasetSource` (:mod:`~mmcache.sources.hfdataset`), both on the shared
:mod:`~mmcache.sources.rows`, and :class:`CocoSource` (:mod:`~mmcache.sources.coco`,
a FileSource); tar shards: :class:`WebDatasetSource` (:mod:`~mmcache.sources.wds`).
:mod:`~mmcache.sources.open` is the registry of formats that
``mmcache.open_source(path)`` sniffs (:func:`register_source_format`).
"""

from mmcache.sources.base import OnError, SampleSource, StampKind
from mmcache.sources.coco import CocoSource
from mmcache.sources.files import FileSource, Sample
from mmcache.sources.hfdataset import HFDatasetSource
from mmcache.sources.open import register_source_format, source_format_names
from mmcache.sources.parquet import ParquetSource
from mmcache.sources.readers import read_manifest, reader_names, register_reader
from mmcache.sources.records import RecordReject, Records, RecordsBuilder
from mmcache.sources.rejects import Reject
from mmcache.sources.wds import WebDatasetSource
from mmcache.transforms.pipeline import RecordProcessor

__all__ = [
    "CocoSource",
    "FileSource",
    "HFDatasetSource",
    "OnError",
    "ParquetSource",
    "RecordProcessor",
    "RecordReject",
    "Records",
    "RecordsBuilder",
    "Reject",
    "Sample",
    "SampleSource",
    "StampKind",
    "WebDatasetSource",
    "read_manifest",
    "reader_names",
    "register_reader",
    "register_source_format",
    "source_format_names",
]
