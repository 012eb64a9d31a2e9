"""Sample sources: where samples come from (the protocol is in :mod:`mmcache.sources.base`).

:class:`FileSource` (:mod:`~mmcache.sources.files`) is the source of manifest
records with one image file each; the records are read by
:mod:`~mmcache.sources.readers` (a registry of manifest formats) into the
columnar :class:`Records` of :mod:`~mmcache.sources.records`; skipped samples
go to the process-shared log of :mod:`~mmcache.sources.rejects`.
"""

from mmcache.sources.base import OnError, SampleSource, StampKind
from mmcache.sources.files import FileSource, RecordProcessor, Sample
from mmcache.sources.readers import read_manifest, reader_names, register_reader
from mmcache.sources.records import RecordReject, Records, RecordsBuilder
from mmcache.sources.rejects import Reject

__all__ = [
    "FileSource",
    "OnError",
    "RecordProcessor",
    "RecordReject",
    "Records",
    "RecordsBuilder",
    "Reject",
    "Sample",
    "SampleSource",
    "StampKind",
    "read_manifest",
    "reader_names",
    "register_reader",
]
