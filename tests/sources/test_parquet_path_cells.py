"""A Parquet image column of HF ``Image`` structs whose every row names a file by path:
pyarrow infers ``struct<bytes: null, path: string>`` for it (the ``bytes`` field of a
column of all-null bytes is typed ``null``). It was refused at open ("a struct whose
'bytes' field is null") though its paths are fine (the new user's item 12)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import mmcache as mc
from mmcache.loader import DataLoader
from mmcache.sources.files import FileSource
from mmcache.synth import make_dataset
from mmcache.transforms.pipeline import Pipeline


def test_an_image_struct_whose_bytes_are_typed_null_is_read_from_its_paths(
    small_pipeline: Pipeline, tmp_path: Path
) -> None:
    manifest = make_dataset(tmp_path / "loose", 6, seed=4)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    # what datasets/pyarrow write for Image() cells of paths: no type given, inferred
    cells = pa.array([{"bytes": None, "path": r["image_path"]} for r in rows])
    assert pa.types.is_null(cells.type.field("bytes").type)
    table = pa.table(
        {
            "id": [r["id"] for r in rows],
            "image": cells,
            "text": [r["caption"] for r in rows],
        }
    )
    path = manifest.parent / "paths.parquet"  # relative paths: from the file's folder
    pq.write_table(table, path)
    ds = mc.open_source(path, pipeline=small_pipeline, columns={"id": "id"})
    loose = FileSource(manifest, pipeline=small_pipeline)
    got = {
        sid: b["image"][i].numpy()
        for b in DataLoader(ds, cache=None, batch_size=3, shuffle=False)
        for i, sid in enumerate(b["id"])
    }
    assert sorted(got) == [r["id"] for r in rows]
    for i in range(len(loose)):
        np.testing.assert_array_equal(got[loose.sample_id(i)], loose.produce(i)["image"])
    # keyed by the files they name: a file rewritten in place changes its row's key
    before = ds.key(2)
    image = manifest.parent / rows[2]["image_path"]
    image.write_bytes((manifest.parent / rows[3]["image_path"]).read_bytes())
    st = image.stat()
    os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    assert ds.key(2) != before
