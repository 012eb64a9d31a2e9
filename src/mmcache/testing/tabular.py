"""The same samples as loose files + JSONL, as Parquet, as a saved HF dataset and as COCO
captions: writers for tests and benchmarks of the tabular sources.

Each writer takes a JSONL manifest (:func:`mmcache.synth.make_dataset` writes one)
and stores the very bytes of its image files, so every source decodes exactly
what the loose files hold and their batches can be compared bit for bit.
Not thread-safe (each writes its own output files).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from mmcache.sources.readers import read_manifest

__all__ = ["manifest_rows", "write_coco", "write_hf_dataset", "write_parquet"]


def manifest_rows(manifest: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """``[{"id", "image_path", "text", "bytes"}]`` of a JSONL manifest, in order."""
    records = read_manifest(manifest)
    out = []
    for i in range(len(records)):
        path = records.image_path(i)
        assert path is not None
        out.append(
            {
                "id": records.id(i),
                "image_path": path,
                "text": records.text(i),
                "bytes": Path(path).read_bytes(),
            }
        )
    return out


def write_parquet(
    manifest: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    files: int = 1,
    row_group_size: int = 16,
    layout: Literal["struct", "binary"] = "struct",
    columns: tuple[str, str, str] = ("id", "image", "text"),
) -> list[Path]:
    """Write the manifest's samples to ``files`` Parquet files under ``out`` (a folder);
    return their paths, in row order.

    ``layout="struct"``: the image column is the HF ``{bytes, path}`` struct;
    ``"binary"``: the encoded bytes. ``columns``: the id, image and text column names.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = manifest_rows(manifest)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    id_name, image_name, text_name = columns
    per_file = -(-len(rows) // files)
    paths = []
    for k in range(files):
        part = rows[k * per_file : (k + 1) * per_file]
        if layout == "struct":
            image = pa.array(
                [{"bytes": r["bytes"], "path": None} for r in part],
                type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
            )
        else:
            image = pa.array([r["bytes"] for r in part], type=pa.binary())
        table = pa.table(
            {
                id_name: pa.array([r["id"] for r in part], type=pa.string()),
                image_name: image,
                text_name: pa.array([r["text"] for r in part], type=pa.string()),
            }
        )
        path = folder / f"part-{k:05d}.parquet"
        pq.write_table(table, path, row_group_size=row_group_size)
        paths.append(path)
    return paths


def write_hf_dataset(manifest: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Save the manifest's samples as an HF dataset (``Image`` feature ``image``, ``text``,
    ``id``) with ``save_to_disk`` to ``out``; ``datasets.load_from_disk(out)`` opens it."""
    import datasets

    rows = manifest_rows(manifest)
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "image": datasets.Image(),
            "text": datasets.Value("string"),
        }
    )
    ds = datasets.Dataset.from_dict(
        {
            "id": [r["id"] for r in rows],
            "image": [{"bytes": r["bytes"], "path": None} for r in rows],
            "text": [r["text"] for r in rows],
        },
        features=features,
    )
    ds.save_to_disk(os.fspath(out))
    return Path(out)


def write_coco(
    manifest: str | os.PathLike[str], out: str | os.PathLike[str], *, captions_per_image: int = 1
) -> Path:
    """Write a COCO captions JSON at ``out`` for the manifest's image files (``file_name``
    relative to the manifest's folder, the image root). Annotation ``k`` of image ``i``
    has the id ``"<manifest id>"`` for ``k == 0`` and ``"<id>-<k>"`` after, caption
    ``"<text>"`` then ``"<text> (k)"``."""
    rows = manifest_rows(manifest)
    base = os.path.dirname(os.path.abspath(manifest))
    images, annotations = [], []
    for n, r in enumerate(rows):
        images.append({"id": n, "file_name": os.path.relpath(r["image_path"], base)})
        for k in range(captions_per_image):
            annotations.append(
                {
                    "id": r["id"] if k == 0 else f"{r['id']}-{k}",
                    "image_id": n,
                    "caption": r["text"] if k == 0 else f"{r['text']} ({k})",
                }
            )
    Path(out).write_text(json.dumps({"images": images, "annotations": annotations}))
    return Path(out)
