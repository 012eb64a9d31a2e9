"""WebDataset tar shards as a :class:`~mmcache.sources.base.SampleSource`, read in place.

:mod:`.index` the member index of a shard (tar headers, kept as JSON by shard stamp);
:mod:`.table` shard patterns and the grouping of members into samples by key;
:mod:`.source` :class:`WebDatasetSource`; :mod:`.keyparts` the identity of its key table;
:mod:`.write` :func:`write_shards` (shards of a loose-file manifest, for tests and
benchmarks).

:func:`sniff` and :func:`open_source` are the ``"wds"`` entry of a source-format
registry (``register_source_format("wds", sniff, open_source)``).
"""

from __future__ import annotations

import os
from typing import Any

from mmcache.sources.wds.source import IMAGE_EXTS, WebDatasetSource
from mmcache.sources.wds.write import write_shards

__all__ = ["IMAGE_EXTS", "WebDatasetSource", "open_source", "sniff", "write_shards"]


def sniff(location: str | os.PathLike[str] | Any) -> bool:
    """Whether ``location`` names tar shards (a ``.tar`` path, glob, brace pattern or URL,
    or a list of them)."""
    if isinstance(location, list | tuple):
        return bool(location) and all(sniff(x) for x in location)
    if not isinstance(location, str | os.PathLike):
        return False
    return os.fspath(location).split("?", 1)[0].endswith(".tar")


def open_source(location: Any, **options: Any) -> WebDatasetSource:
    """``WebDatasetSource(location, **options)`` (``pipeline=`` and the source's options)."""
    return WebDatasetSource(location, **options)
