"""The recipes' own mixture files, read as they are: InternVL's meta JSON and
LLaVA-OneVision's data YAML, each into the :class:`~mmcache.sources.mixparts.MixturePart`
list of a :class:`mmcache.Mixture` (one :class:`~mmcache.sources.files.FileSource` per
entry, its records read by :func:`~mmcache.sources.readers.read_manifest`).

**InternVL** (``internvl_chat`` fine-tuning, ``--meta_path``)::

    {"name": {"root": "images/", "annotation": "name.jsonl", "repeat_time": 1,
              "length": 1000, "data_augment": false, "max_dynamic_patch": 12}, ...}

``annotation`` lists JSONL records (``id``, ``image`` relative to ``root`` (one path or a
list), ``conversations``); the part is named by its key. ``repeat_time`` >= 1 is the
part's ``repeat`` (InternVL repeats the list; a fraction above 1 walks as
:class:`mmcache.Mixture` says); below 1 it keeps a fixed seeded subset of
``int(len * repeat_time)`` records, as InternVL does, each read once per epoch.
``length`` is checked against the records read (a warning when they differ); the
model-side keys (``data_augment``, ``max_dynamic_patch``...) belong to the pipeline and are
not read.

**LLaVA-OneVision** (LLaVA-NeXT's ``--data_path`` YAML)::

    datasets:
      - json_path: data/llava_image.json
        sampling_strategy: all          # first:N | end:N | random:N, N a count or P%

``json_path`` is a LLaVA JSON array or JSONL; images are relative to ``image_folder``,
videos to ``video_folder`` (default: ``image_folder``). ``N%`` is
``ceil(P * len / 100)``, as LLaVA-NeXT's ``LazySupervisedDataset`` computes it;
``random:N`` keeps a fixed seeded subset (LLaVA-NeXT reshuffles it on every start: here a
restart sees the same samples, so a resume is exact). Each entry is a part named by its
file (``name-2`` for a file listed again), read once per epoch.

Relative paths in both files resolve against ``base_dir``: the working directory by
default, as the recipes' training scripts open them. A path that does not exist is a
:class:`~mmcache.errors.ManifestError` naming the mixture file and the entry; a bad
value (a ``repeat_time`` that is not a number, an unknown sampling strategy) too.

Thread/process safety: pure functions (each call reads its files).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from mmcache.checks import shown
from mmcache.errors import ConfigError, ManifestError
from mmcache.sources.base import OnError, check_on_error
from mmcache.sources.files import FileSource
from mmcache.sources.mixparts import MixturePart
from mmcache.sources.readers import read_manifest
from mmcache.sources.records import Records

__all__ = ["internvl_parts", "onevision_parts"]

logger = logging.getLogger(__name__)

_STRATEGY = re.compile(r"^(all|first|end|random)(?::(\d+)(%?))?$")


def _read_text(path: str) -> str:
    """The mixture file's text, or a ManifestError naming it."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError as exc:
        raise ManifestError("file not found", path=path) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"cannot read the file: {exc}", path=path) from exc


def _load_json(path: str) -> Any:
    text = _read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ManifestError(
            f"malformed JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})", path=path
        ) from exc


def _load_yaml(path: str) -> Any:
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - an install without the extra
        raise ConfigError(
            "reading a LLaVA-OneVision YAML needs PyYAML: pip install 'mmcache[mixtures]'"
        ) from exc
    text = _read_text(path)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ManifestError(f"malformed YAML: {exc}", path=path) from exc


def _resolve(base: str, ref: str) -> str:
    return os.path.normpath(os.path.join(base, os.path.expanduser(ref)))


def _existing(path: str, *, what: str, entry: str, file: str, folder: bool = False) -> str:
    """``path`` if it exists (a folder when ``folder``), else a ManifestError naming the
    mixture file, the entry and what the path was for."""
    ok = os.path.isdir(path) if folder else os.path.isfile(path)
    if not ok:
        kind = "folder" if folder else "file"
        raise ManifestError(f"entry {entry}: {what} {kind} {path!r} does not exist", path=file)
    return path


def _subset(n: int, k: int, *, seed: int, name: str) -> list[int]:
    """A fixed seeded choice of ``k`` of ``n`` rows, in row order (the same every run)."""
    salt = int(xxhash.xxh64_intdigest(name.encode("utf-8")))
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, salt])))
    return sorted(rng.choice(n, size=k, replace=False).tolist())


def _part(records: Records, *, pipeline: Any, on_error: OnError) -> FileSource:
    return FileSource(records, pipeline=pipeline, on_error=on_error)


def internvl_parts(
    meta_json: str | os.PathLike[str],
    *,
    pipeline: Any,
    base_dir: str | os.PathLike[str] | None = None,
    on_error: OnError = "raise",
    subset_seed: int = 0,
) -> list[MixturePart]:
    """The parts of an InternVL meta file (see the module docstring), in its order."""
    on_error = check_on_error(on_error)
    file = os.fspath(meta_json)
    base = os.fspath(base_dir) if base_dir is not None else os.getcwd()
    meta = _load_json(file)
    if not isinstance(meta, dict) or not meta:
        raise ManifestError(
            "an InternVL meta file is a JSON object of datasets, "
            f'{{"name": {{"root": ..., "annotation": ...}}}}, got {shown(meta)}',
            path=file,
        )
    parts = []
    for name, entry in meta.items():
        where = repr(name)
        if not isinstance(entry, Mapping):
            raise ManifestError(f"entry {where} must be an object, got {shown(entry)}", path=file)
        for key in ("root", "annotation"):
            if not isinstance(entry.get(key), str) or not entry.get(key):
                raise ManifestError(
                    f"entry {where} needs {key!r} (a path), got {shown(entry.get(key))}",
                    path=file,
                )
        root = _existing(
            _resolve(base, entry["root"]), what="root", entry=where, file=file, folder=True
        )
        annotation = _existing(
            _resolve(base, entry["annotation"]), what="annotation", entry=where, file=file
        )
        repeat = entry.get("repeat_time", 1)
        if isinstance(repeat, bool) or not isinstance(repeat, (int, float)) or not repeat > 0:
            raise ManifestError(
                f"entry {where}: repeat_time must be a number > 0, got {shown(repeat)}",
                path=file,
            )
        records = read_manifest(annotation, on_error=on_error, image_root=root)
        length = entry.get("length")
        if isinstance(length, int) and length != len(records):
            logger.warning(
                "%s: entry %s says length %d but %s holds %d records",
                file,
                where,
                length,
                annotation,
                len(records),
            )
        if repeat < 1:  # InternVL keeps a fixed subset of int(len * repeat_time) records
            keep = _subset(len(records), int(len(records) * repeat), seed=subset_seed, name=name)
            records = records.select(keep, [])
            repeat = 1
        source = _part(records, pipeline=pipeline, on_error=on_error)
        parts.append(MixturePart(source, name=str(name), repeat=repeat))
    return parts


def _sampled(
    records: Records, strategy: object, *, where: str, file: str, seed: int, name: str
) -> Records:
    """``records`` as a OneVision ``sampling_strategy`` keeps them."""
    match = _STRATEGY.match(strategy) if isinstance(strategy, str) else None
    if match is None or (match.group(1) != "all" and match.group(2) is None):
        raise ManifestError(
            f"entry {where}: sampling_strategy must be 'all', 'first:N', 'end:N' or "
            f"'random:N' (N a count or a percentage, 'random:10%'), got {shown(strategy)}",
            path=file,
        )
    kind, number, percent = match.groups()
    n = len(records)
    if kind == "all":
        return records
    count = math.ceil(int(number) * n / 100) if percent else int(number)
    if count < 1:
        raise ManifestError(
            f"entry {where}: sampling_strategy {strategy!r} keeps no sample of {n}", path=file
        )
    count = min(count, n)
    if kind == "first":
        rows = list(range(count))
    elif kind == "end":
        rows = list(range(n - count, n))
    else:
        rows = _subset(n, count, seed=seed, name=name)
    return records.select(rows, [])


def onevision_parts(
    yaml_path: str | os.PathLike[str],
    *,
    image_folder: str | os.PathLike[str],
    video_folder: str | os.PathLike[str] | None = None,
    pipeline: Any,
    base_dir: str | os.PathLike[str] | None = None,
    on_error: OnError = "raise",
    subset_seed: int = 0,
) -> list[MixturePart]:
    """The parts of a LLaVA-OneVision data YAML (see the module docstring), in its order."""
    on_error = check_on_error(on_error)
    file = os.fspath(yaml_path)
    base = os.fspath(base_dir) if base_dir is not None else os.getcwd()
    images = _existing(
        _resolve(base, os.fspath(image_folder)),
        what="image_folder",
        entry="(argument)",
        file=file,
        folder=True,
    )
    videos = None
    if video_folder is not None:
        videos = _existing(
            _resolve(base, os.fspath(video_folder)),
            what="video_folder",
            entry="(argument)",
            file=file,
            folder=True,
        )
    document = _load_yaml(file)
    datasets = document.get("datasets") if isinstance(document, dict) else None
    if not isinstance(datasets, list) or not datasets:
        raise ManifestError(
            "a LLaVA-OneVision data file is a YAML mapping with a 'datasets' list of "
            f"{{json_path, sampling_strategy}} entries, got {shown(document)}",
            path=file,
        )
    parts = []
    names: dict[str, int] = {}
    for j, entry in enumerate(datasets):
        where = f"datasets[{j}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("json_path"), str):
            raise ManifestError(
                f"entry {where} needs 'json_path' (a path), got {shown(entry)}", path=file
            )
        where = f"datasets[{j}] ({entry['json_path']})"
        json_path = _existing(
            _resolve(base, entry["json_path"]), what="json_path", entry=where, file=file
        )
        stem = Path(json_path).stem
        names[stem] = names.get(stem, 0) + 1
        name = stem if names[stem] == 1 else f"{stem}-{names[stem]}"
        records = read_manifest(json_path, on_error=on_error, image_root=images)
        if videos is not None:
            records = records.with_video_dir(videos)
        records = _sampled(
            records,
            entry.get("sampling_strategy", "all"),
            where=where,
            file=file,
            seed=subset_seed,
            name=name,
        )
        source = _part(records, pipeline=pipeline, on_error=on_error)
        parts.append(MixturePart(source, name=name))
    return parts
