"""Write WebDataset tar shards from a JSONL manifest of loose image files (img2dataset's
layout: ``<key>.jpg``, ``<key>.txt``, ``<key>.json`` with ``width``/``height``).

For tests, benchmarks and users who want shards of their own files; mmcache reads shards
in place and never needs this to train. The bytes of each image are copied unchanged, so
a sample read from a shard equals the same sample read as a loose file. Not thread-safe
(one writer per output directory).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

from PIL import Image

from mmcache.errors import ConfigError

__all__ = ["write_shards"]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def write_shards(
    manifest: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, per_shard: int = 1000
) -> list[Path]:
    """Shards ``out_dir/00000.tar``, ... of the records of a seed JSONL ``manifest``
    (``id``, ``image_path`` relative to the manifest, ``caption``), ``per_shard`` samples
    each; returns their paths. The key of each sample is its id."""
    if not isinstance(per_shard, int) or per_shard < 1:
        raise ConfigError(f"per_shard must be an int >= 1, got {per_shard!r}")
    manifest = Path(manifest)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with manifest.open(encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    paths: list[Path] = []
    for start in range(0, len(records), per_shard):
        path = out / f"{start // per_shard:05d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for rec in records[start : start + per_shard]:
                key = str(rec["id"])
                image = manifest.parent / rec["image_path"]
                data = image.read_bytes()
                with Image.open(io.BytesIO(data)) as im:
                    width, height = im.size
                ext = image.suffix.lower().lstrip(".") or "jpg"
                _add(tar, f"{key}.{ext}", data)
                meta = {"key": key, "width": width, "height": height}
                _add(tar, f"{key}.json", json.dumps(meta).encode())
                if rec.get("caption") is not None:
                    _add(tar, f"{key}.txt", str(rec["caption"]).encode("utf-8"))
        paths.append(path)
    return paths
