"""``mmcache inspect PATH``: what a path is read as, without writing anything.

It prints the format the path is read as (sniffed, or ``--format``), the number of
samples, and the first sample as the pipeline makes it: its id, its cache key and
each field's dtype and shape; ``--json`` gives the same as one JSON object. Nothing
is written: no cache is opened, and a WebDataset shard's member index is built in
memory only (``index_dir=False``), where a training run would keep it on disk.

The pipeline is the one ``mmcache warm`` would use: ``--pipeline module:function``
(the training script's) or the documented default (``--size``, ``--max-length``,
``--tokenizer``), so the key printed is the key the cache would hold.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from mmcache.cliargs import add_data_options, add_pipeline_options, data_options

__all__ = ["add_inspect_parser", "describe", "inspect_path"]


def add_inspect_parser(sub: Any, pipeline_for: Callable[[argparse.Namespace], Any]) -> None:
    """Add ``inspect`` to the CLI's subcommands; ``pipeline_for(args)`` builds the pipeline
    from ``--pipeline`` or the default options (as ``mmcache warm`` does)."""
    p = sub.add_parser("inspect", help="what a path is read as: format, samples, first sample")
    p.add_argument(
        "path", help="a manifest, shards, Parquet file/glob/folder, COCO json, HF dataset"
    )
    add_data_options(p)
    add_pipeline_options(p)
    p.add_argument("--json", action="store_true")

    def run(args: argparse.Namespace) -> int:
        report = inspect_path(args.path, pipeline_for(args), data_options(args))
        print(json.dumps(report, indent=2) if args.json else describe(report))
        return 0

    p.set_defaults(func=run)


def inspect_path(path: str, pipeline: Any, options: dict[str, Any]) -> dict[str, Any]:
    """:func:`_inspect`, with the identity ledger kept in memory (nothing written)."""
    from mmcache.sources import identity

    with identity.memory_only():
        return _inspect(path, pipeline, options)


def _inspect(path: str, pipeline: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``{"path", "format", "samples", "first"}`` of ``path`` read with ``pipeline``;
    ``first`` is ``None`` for an empty source, else ``{"index", "id", "key", "fields"}``
    with ``fields`` ``{name: {"dtype", "shape"}}``. ``options``: ``format``,
    ``columns``, ``image_root`` as ``MultimodalDataset`` takes them. Writes nothing.
    Raises the source's ManifestError/SampleError (naming the file and the sample)
    when the path or its first sample cannot be read."""
    from mmcache.dataset import MultimodalDataset
    from mmcache.sources.open import sniff_format
    from mmcache.sources.wds import WebDatasetSource

    options = dict(options)
    given = options.pop("format", "auto")
    fmt = sniff_format(path) if given == "auto" else given
    source: Any
    if fmt == "wds":  # keep the shard index in memory: inspecting writes nothing
        source = WebDatasetSource(path, pipeline=pipeline, index_dir=False)
    else:
        source = MultimodalDataset(path, pipeline=pipeline, format=fmt, **options)
    report: dict[str, Any] = {
        "path": path,
        "format": fmt if given == "auto" else f"{fmt} (given)",
        "samples": len(source),
        "first": None,
    }
    if len(source):
        sample = source.produce(0)
        report["first"] = {
            "index": 0,
            "id": source.sample_id(0),
            "key": source.key(0).hex(),
            "fields": {
                name: {"dtype": str(value.dtype), "shape": list(value.shape)}
                for name, value in sample.items()
            },
        }
    return report


def describe(report: dict[str, Any]) -> str:
    """The text ``mmcache inspect`` prints for a report of :func:`inspect_path`."""
    lines = [
        f"path:    {report['path']}",
        f"format:  {report['format']}",
        f"samples: {report['samples']:,}",
    ]
    first = report["first"]
    if first is None:
        lines.append("first sample: none (the source is empty)")
        return "\n".join(lines)
    lines.append(f"first sample: index {first['index']}, id {first['id']!r}")
    lines.append(f"  key:   {first['key']}")
    width = max(len(name) for name in first["fields"]) if first["fields"] else 0
    for name, field in first["fields"].items():
        shape = "[" + ", ".join(str(n) for n in field["shape"]) + "]"
        lines.append(f"  {name:<{width}}  {field['dtype']:<8} {shape}")
    return "\n".join(lines)
