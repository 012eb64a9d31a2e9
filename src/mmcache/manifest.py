"""Old import path of the manifest readers (kept for users).

The code lives in :mod:`mmcache.sources.records` (:class:`Records`, the record
reject; ``Reject`` is its old name, deprecated) and :mod:`mmcache.sources.readers`
(:func:`read_manifest`, :func:`llava_text` and the reader registry).
"""

import warnings
from typing import Any

from mmcache.sources.readers import IMAGE_TOKEN, llava_text, read_manifest, register_reader
from mmcache.sources.records import RecordReject, Records

__all__ = [
    "IMAGE_TOKEN",
    "RecordReject",
    "Records",
    "llava_text",
    "read_manifest",
    "register_reader",
]


def __getattr__(name: str) -> Any:
    """``Reject``, the old name of :class:`RecordReject`: one name was two classes
    (``mmcache.Reject`` is a sample's reject), so this one warns and goes next release."""
    if name == "Reject":
        warnings.warn(
            "mmcache.manifest.Reject is mmcache.sources.RecordReject (a manifest record's "
            "reject; mmcache.dataset.Reject is a sample's); the old name goes in the next "
            "release",
            DeprecationWarning,
            stacklevel=2,
        )
        return RecordReject
    raise AttributeError(f"module 'mmcache.manifest' has no attribute {name!r}")
