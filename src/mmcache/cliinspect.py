"""``mmcache inspect PATH``: what a path is read as, without writing anything.

It prints the format the path is read as (sniffed, or ``--format``), the number of
samples, and the first sample the pipeline can make: its id, its cache key and each
field's dtype and shape; ``--json`` gives the same as one JSON object. Nothing is
written: no cache is opened, and a WebDataset shard's member index is built in
memory only (``index_dir=False``), where a training run would keep it on disk.

The first sample is looked for among the first :data:`TRIES` (records the pipeline
refuses are counted, with the first reason): one record says little about a file
that mixes kinds, such as a chat file whose first record is text-only. A manifest's
records are also counted whole (with images, text-only, conversations: their image
counts are a column), and a chat file read with a pipeline that has no ``ChatSpec``
gets the advice the SFT recipe gives (``docs/recipes/sft.md``): each conversation
would otherwise be tokenized as one caption, and its text-only records refused.

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

__all__ = ["TRIES", "add_inspect_parser", "describe", "first_sample", "inspect_path"]

#: Samples tried, in order, for one the pipeline can make.
TRIES = 100
#: Refusals listed in a report (all are counted).
_LISTED = 3


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
    """:func:`_inspect`, with the identity ledger kept in memory and the manifest parsed in
    memory (nothing written)."""
    from mmcache.sources import identity, nodecolumns

    with identity.memory_only(), nodecolumns.memory_only():
        return _inspect(path, pipeline, options)


def first_sample(source: Any, *, limit: int = TRIES) -> tuple[int | None, Any, list[Any]]:
    """``(index, sample, refused)``: the first of the first ``limit`` samples of ``source``
    that its pipeline makes (each made once), or ``(None, None, refused)``; ``refused``
    lists the SampleErrors of those tried before it, in order."""
    from mmcache.errors import SampleError

    refused: list[SampleError] = []
    for i in range(min(len(source), limit)):
        try:
            return i, source.produce(i), refused
        except SampleError as exc:
            refused.append(exc)
    return None, None, refused


def _records_profile(source: Any) -> dict[str, Any] | None:
    """What a manifest's records hold, counted over all of them: ``{"records",
    "with_images", "text_only", "chat", "video"}``; None for a source of another kind."""
    from mmcache.sources.files import FileSource

    if not isinstance(source, FileSource):
        return None
    records = source.records
    images = records.image_counts()
    return {
        "records": len(records),
        "with_images": int((images > 0).sum()),
        "text_only": int((images == 0).sum()),
        "chat": records.has_chats,
        "video": records.has_videos,
    }


def _advice(profile: dict[str, Any] | None, pipeline: Any) -> list[str]:
    """What to change for the data found: a chat file needs a pipeline with a ChatSpec
    (the SFT recipe's), with an image stage when some records have images."""
    if profile is None or not profile["chat"] or pipeline.chat is not None:
        return []
    image = "mc.ImageSpec(size=336)" if profile["with_images"] else "None"
    return [
        f"chat records (conversations): {profile['with_images']} with images,"
        f" {profile['text_only']} text-only. This pipeline has no ChatSpec: each"
        " conversation is tokenized as one caption (no chat template, no labels) and"
        " text-only records are refused. For supervised fine-tuning pass --pipeline"
        f" module:function returning mc.Pipeline(image={image},"
        " text=mc.ChatSpec(tokenizer, template, max_length=...)), which keeps text-only"
        " records as text-only samples (docs/recipes/sft.md; an HF processor's:"
        " docs/recipes/hf-processors.md)"
    ]


def _inspect(path: str, pipeline: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``{"path", "format", "samples", "records", "first", "refused", "advice"}`` of
    ``path`` read with ``pipeline``.

    ``first``: the first sample the pipeline makes among the first :data:`TRIES`, as
    ``{"index", "id", "key", "fields"}`` with ``fields`` ``{name: {"dtype", "shape"}}``;
    ``None`` for an empty source. ``refused``: ``{"tried", "count", "first"}``, the
    samples tried before it that the pipeline refused and the first few of them
    (``{"index", "id", "reason"}``). ``records``: :func:`_records_profile`. ``advice``:
    lines saying what to change. ``options``: ``format``, ``columns``, ``image_root``
    as ``mmcache.open_source`` takes them. Writes nothing.

    Raises the source's ManifestError (naming the file) when the path cannot be
    read, and ConfigError naming the first refusal and the advice when none of the
    samples tried can be made.
    """
    from mmcache.dataset import open_source
    from mmcache.errors import ConfigError
    from mmcache.sources.open import sniff_format
    from mmcache.sources.wds import WebDatasetSource

    options = dict(options)
    given = options.pop("format", "auto")
    fmt = sniff_format(path) if given == "auto" else given
    source: Any
    if fmt == "wds":  # keep the shard index in memory: inspecting writes nothing
        source = WebDatasetSource(path, pipeline=pipeline, index_dir=False)
    else:
        source = open_source(path, pipeline=pipeline, format=fmt, **options)
    profile = _records_profile(source)
    index, sample, refused = first_sample(source)
    advice = _advice(profile, pipeline)
    if len(source) and index is None:
        first = refused[0]
        raise ConfigError(
            f"{path}: none of the first {len(refused)} samples can be made with this"
            f" pipeline; the first refused: {first}" + "".join(f"; {line}" for line in advice)
        )
    report: dict[str, Any] = {
        "path": path,
        "format": fmt if given == "auto" else f"{fmt} (given)",
        "samples": len(source),
        "records": profile,
        "first": None,
        "refused": {
            "tried": len(refused) + (index is not None),
            "count": len(refused),
            "first": [
                {"index": i, "id": exc.sample_id, "reason": exc.reason}
                for i, exc in enumerate(refused[:_LISTED])
            ],
        },
        "advice": advice,
    }
    if index is not None:
        report["first"] = {
            "index": index,
            "id": source.sample_id(index),
            "key": source.key(index).hex(),
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
    records = report.get("records")
    if records is not None:
        kinds = f"{records['with_images']:,} with images, {records['text_only']:,} text-only"
        chat = ", conversations" if records["chat"] else ""
        lines.append(f"records: {kinds}{chat}{', videos' if records['video'] else ''}")
    first = report["first"]
    if first is None:
        lines.append("first sample: none (the source is empty)")
        return "\n".join(lines)
    refused = report.get("refused") or {"count": 0, "first": []}
    if refused["count"]:
        lines.append(f"refused: {refused['count']} samples before it, the first:")
        lines += [f"  index {r['index']}, id {r['id']!r}: {r['reason']}" for r in refused["first"]]
    lines.append(f"first sample: index {first['index']}, id {first['id']!r}")
    lines.append(f"  key:   {first['key']}")
    width = max(len(name) for name in first["fields"]) if first["fields"] else 0
    for name, field in first["fields"].items():
        shape = "[" + ", ".join(str(n) for n in field["shape"]) + "]"
        lines.append(f"  {name:<{width}}  {field['dtype']:<8} {shape}")
    lines += [f"advice: {line}" for line in report.get("advice", [])]
    return "\n".join(lines)
