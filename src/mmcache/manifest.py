"""Old import path of the manifest readers (kept for users).

The code lives in :mod:`mmcache.sources.records` (:class:`Records`, the record
reject, here still called :class:`Reject`) and :mod:`mmcache.sources.readers`
(:func:`read_manifest`, :func:`llava_text` and the reader registry).
"""

from mmcache.sources.readers import IMAGE_TOKEN, llava_text, read_manifest, register_reader
from mmcache.sources.records import RecordReject, Records

#: The old name of :class:`~mmcache.sources.records.RecordReject`.
Reject = RecordReject

__all__ = [
    "IMAGE_TOKEN",
    "RecordReject",
    "Records",
    "Reject",
    "llava_text",
    "read_manifest",
    "register_reader",
]
