"""A local Parquet file rewritten at the same size within its stamp's timestamp tick gets
new keys: the source's per-process memo of file identities follows the identity
ledger's racy rule (a digest stands for a stamp only once the stamp is
``RACY_SECONDS`` older than the read). Before, the memo kept the first digest for the
rest of the process, and the rewritten rows were served under the old keys."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from test_ledger_racy import TICK_NS, FakeClock, book, one_tick  # noqa: F401 (fixtures)

import mmcache as mc
from mmcache.sources import identity
from mmcache.synth import make_dataset
from mmcache.transforms import TextSpec
from mmcache.transforms.pipeline import Pipeline


def _write(path: Path, caption: str) -> None:
    pq.write_table(pa.table({"id": ["a", "b"], "text": [caption, caption]}), path)


def _text_only(tokenizer_json: Path) -> Pipeline:
    return Pipeline(text=TextSpec(tokenizer_json, max_length=8))


def test_a_same_tick_rewrite_of_a_parquet_file_gets_new_keys(
    tmp_path: Path,
    tokenizer_json: Path,
    one_tick: None,  # noqa: F811 (the fixture)
    book: Callable[[], tuple[identity.Ledger, FakeClock]],  # noqa: F811 (the fixture)
) -> None:
    path = tmp_path / "t.parquet"
    _write(path, "one cat")
    _, clock = book()
    ds = mc.open_source(
        path, pipeline=_text_only(tokenizer_json), columns={"id": "id", "image": None}
    )
    before, size = ds.key(0), path.stat().st_size
    _write(path, "two dog")  # the same size, and (one_tick) the same stamp
    assert path.stat().st_size == size
    assert ds.key(0) != before, "the old digest was served for a rewritten file"
    clock.now = TICK_NS / 1e9 + identity.RACY_SECONDS + 1  # old enough from now on
    settled = ds.key(0)
    assert settled != before
    assert ds.key(0) == settled


def test_a_same_tick_rewrite_of_a_loose_file_gets_new_keys_in_the_same_source(
    tmp_path: Path,
    small_pipeline: Pipeline,
    one_tick: None,  # noqa: F811 (the fixture)
    book: Callable[[], tuple[identity.Ledger, FakeClock]],  # noqa: F811 (the fixture)
) -> None:
    """The same within one source object (one training run): the source's key memo
    keeps a key for an unchanged stamp only once the stamp is old enough."""
    manifest = make_dataset(tmp_path / "loose", 3, seed=4)
    _, clock = book()
    ds = mc.MultimodalDataset(manifest, pipeline=small_pipeline)
    first = ds.keys([0, 1, 2])
    row = json.loads(manifest.read_text().splitlines()[0])
    image = manifest.parent / row["image_path"]
    data = bytearray(image.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size, and (one_tick) the same stamp
    with open(image, "r+b") as fh:
        fh.write(data)
    again = ds.keys([0, 1, 2])
    assert again[0] != first[0], "the old key was served for a rewritten file"
    assert again[1:] == first[1:]
    clock.now = TICK_NS / 1e9 + identity.RACY_SECONDS + 1  # old enough from now on
    assert ds.keys([0, 1, 2]) == again
