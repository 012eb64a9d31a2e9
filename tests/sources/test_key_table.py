"""The node's key table (issue 41): keys shared by every process and kept for the next run.

:mod:`mmcache.sources.keytable`: a source over a manifest's column file keys each sample
once per node: a new source (a worker, the prefetcher, another rank, the next run) finds
its keys in the table and computes none; a torn or damaged row, a changed file or an
edited caption is keyed again; a table file that is a link, another user's or open to
others is refused and made again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash

from mmcache import Pipeline, keys
from mmcache.sources import identity, keytable
from mmcache.sources.files import FileSource


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's column and key-table folder (inherited by child processes)."""
    where = tmp_path / "columns"
    monkeypatch.setenv("MMCACHE_COLUMNS_DIR", str(where))
    return where


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files written by the test count as old enough for their stamps to vouch for keys
    (the racy window is what keeps a just-written file's key out of the table)."""
    monkeypatch.setattr(identity, "RACY_SECONDS", -1.0)


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many keys ``keys.sample_key`` made in this process (``[count]``)."""
    calls = [0]
    real = keys.sample_key

    def counted(*args: object) -> bytes:
        calls[0] += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(keys, "sample_key", counted)
    yield calls


def dataset(root: Path, n: int, caption: str = "a caption") -> Path:
    """``n`` records of small image files and one caption: the manifest's path."""
    (root / "img").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / "img" / f"{i}.jpg").write_bytes(f"image {i}".encode())
    manifest = root / "data.jsonl"
    rows = [{"id": f"s{i}", "image_path": f"img/{i}.jpg", "caption": caption} for i in range(n)]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return manifest


def source(manifest: Path, pipeline: Pipeline) -> FileSource:
    return FileSource(manifest, pipeline=pipeline)


def table_path(src: FileSource) -> str:
    table = src.key_table(4)
    assert isinstance(table, keytable.KeyTable)
    return table.path


def test_row_checks_are_xxh64_of_each_row() -> None:
    rng = np.random.default_rng(0)
    for m in (1, 3, 4, 7, 9):
        words = rng.integers(0, 2**63, size=(5, m), dtype=np.int64).view(np.uint64)
        got = keytable.row_checks(words, 12345)
        want = [xxhash.xxh64_intdigest(words[i].astype("<u8").tobytes(), 12345) for i in range(5)]
        assert got.tolist() == want


def test_a_new_source_computes_no_key(
    tmp_path: Path, folder: Path, settled: None, hashed: list[int], small_pipeline: Pipeline
) -> None:
    manifest = dataset(tmp_path, 40)
    first = source(manifest, small_pipeline).keys(range(40))
    assert hashed[0] == 40
    again = source(manifest, small_pipeline)  # a new run: its own process state
    assert again.keys(range(40)) == first
    assert hashed[0] == 40  # none computed again


_CHILD = """
import json, sys
from mmcache import keys
from mmcache.sources import identity
from mmcache.sources.files import FileSource
from mmcache.transforms.pipeline import Pipeline
from mmcache.transforms import ImageSpec, TextSpec
identity.RACY_SECONDS = -1.0
calls = [0]
real = keys.sample_key
def counted(*a):
    calls[0] += 1
    return real(*a)
keys.sample_key = counted
pipe = Pipeline(image=ImageSpec(size=64), text=TextSpec(sys.argv[2], max_length=16))
src = FileSource(sys.argv[1], pipeline=pipe)
print(json.dumps({"hashed": calls[0] if src.keys(range(30)) else -1,
                  "keys": [k.hex() for k in src.keys(range(30))]}))
"""


def _children(manifest: Path, tokenizer_json: Path, count: int) -> list[dict[str, object]]:
    """:data:`_CHILD` in ``count`` new interpreters at once: what each printed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    argv = [sys.executable, "-c", _CHILD, str(manifest), str(tokenizer_json)]
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True) for _ in range(count)
    ]
    outs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    return [json.loads(out.splitlines()[-1]) for out in outs]


def test_a_second_process_computes_no_key(
    tmp_path: Path, folder: Path, tokenizer_json: Path
) -> None:
    manifest = dataset(tmp_path, 30)
    [first] = _children(manifest, tokenizer_json, 1)
    [second] = _children(manifest, tokenizer_json, 1)
    assert first["hashed"] == 30
    assert second == {"hashed": 0, "keys": first["keys"]}


def test_processes_keying_at_once_leave_a_table_of_right_rows(
    tmp_path: Path, folder: Path, tokenizer_json: Path
) -> None:
    manifest = dataset(tmp_path, 30)
    together = _children(manifest, tokenizer_json, 3)  # writing the same rows at once
    assert len({json.dumps(got["keys"]) for got in together}) == 1
    [after] = _children(manifest, tokenizer_json, 1)
    assert after == {"hashed": 0, "keys": together[0]["keys"]}


def test_a_damaged_or_torn_row_is_never_used(
    tmp_path: Path, folder: Path, settled: None, hashed: list[int], small_pipeline: Pipeline
) -> None:
    manifest = dataset(tmp_path, 10)
    src = source(manifest, small_pipeline)
    want = src.keys(range(10))
    path, width = table_path(src), 8 * 7
    with open(path, "r+b") as f:
        # Row 3: one bit of its key flipped. Row 5: the key of row 6 under row 5's stamp
        # and check (a torn write: an old key beside a new stamp).
        f.seek(keytable.HEADER + 3 * width)
        row = bytearray(f.read(width))
        row[0] ^= 1
        f.seek(keytable.HEADER + 3 * width)
        f.write(row)
        f.seek(keytable.HEADER + 6 * width)
        other = f.read(16)
        f.seek(keytable.HEADER + 5 * width)
        f.write(other)
    hashed[0] = 0
    again = source(manifest, small_pipeline)
    assert again.keys(range(10)) == want
    assert hashed[0] == 2  # rows 3 and 5 computed again (and written back whole)
    assert source(manifest, small_pipeline).keys(range(10)) == want
    assert hashed[0] == 2


def test_a_changed_file_gets_a_new_key(
    tmp_path: Path, folder: Path, settled: None, small_pipeline: Pipeline
) -> None:
    manifest = dataset(tmp_path, 5)
    before = source(manifest, small_pipeline).keys(range(5))
    (tmp_path / "img" / "2.jpg").write_bytes(b"another image, another size")
    after = source(manifest, small_pipeline).keys(range(5))
    assert after[2] != before[2]
    assert after[:2] == before[:2] and after[3:] == before[3:]


def test_an_edited_caption_gets_a_new_table(
    tmp_path: Path, folder: Path, settled: None, hashed: list[int], small_pipeline: Pipeline
) -> None:
    manifest = dataset(tmp_path, 5, caption="a cat")
    src = source(manifest, small_pipeline)
    before, old_table = src.keys(range(5)), table_path(src)
    dataset(tmp_path, 5, caption="a dog")  # the same ids and image files
    edited = source(manifest, small_pipeline)
    after = edited.keys(range(5))
    assert table_path(edited) != old_table
    assert all(a != b for a, b in zip(after, before, strict=True))
    assert hashed[0] == 10
    assert not os.path.exists(old_table)  # swept: its column file was rebuilt


@pytest.mark.usefixtures("folder", "settled")
@pytest.mark.parametrize("planted", ["symlink", "hardlink", "open to others"])
def test_a_refused_table_file_is_made_again(
    tmp_path: Path, hashed: list[int], small_pipeline: Pipeline, planted: str
) -> None:
    manifest = dataset(tmp_path, 6)
    src = source(manifest, small_pipeline)
    want, path = src.keys(range(6)), table_path(src)
    elsewhere = tmp_path / "elsewhere.keys"
    os.replace(path, elsewhere)
    if planted == "symlink":
        os.symlink(elsewhere, path)
    elif planted == "hardlink":
        os.link(elsewhere, path)
    else:
        os.replace(elsewhere, path)
        os.chmod(path, 0o666)
    hashed[0] = 0
    again = source(manifest, small_pipeline)
    assert again.keys(range(6)) == want
    assert hashed[0] == 6  # nothing read from the refused file
    st = os.lstat(path)
    assert st.st_nlink == 1 and not st.st_mode & 0o077 and not os.path.islink(path)


def test_a_young_file_is_not_written_to_the_table(
    tmp_path: Path, folder: Path, hashed: list[int], small_pipeline: Pipeline
) -> None:
    manifest = dataset(tmp_path, 4)  # written now: within the racy window
    source(manifest, small_pipeline).keys(range(4))
    source(manifest, small_pipeline).keys(range(4))
    assert hashed[0] == 8


def test_without_a_column_file_keys_stay_in_the_process(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    settled: None,
    hashed: list[int],
    small_pipeline: Pipeline,
) -> None:
    monkeypatch.setenv("MMCACHE_COLUMNS_DIR", "off")
    manifest = dataset(tmp_path, 4)
    src = source(manifest, small_pipeline)
    src.keys(range(4))
    src.keys(range(4))  # the private memo
    assert hashed[0] == 4
    assert src.key_table(4) is None


def test_a_table_unused_for_long_is_swept(tmp_path: Path) -> None:
    old = keytable.open_table(str(tmp_path), keytable.table_identity(["old pipeline"]), 3, 4)
    kept = keytable.open_table(str(tmp_path), keytable.table_identity(["in use"]), 3, 4)
    assert old is not None and kept is not None
    month = keytable.UNUSED_SECONDS + 86400
    os.utime(old.path, (os.path.getatime(old.path), os.path.getmtime(old.path) - month))
    keytable.open_table(str(tmp_path), keytable.table_identity(["new"]), 3, 4)
    assert not os.path.exists(old.path)
    assert os.path.exists(kept.path)


def test_gc_sweeps_the_tables_of_deleted_manifests(
    tmp_path: Path, folder: Path, settled: None, small_pipeline: Pipeline
) -> None:
    """A build sweeps at most 64 tables, and only when a table is made: ``gc`` sweeps every
    table whose column file went (the manifest deleted), with those column files."""
    import mmcache

    live = source(dataset(tmp_path / "live", 4), small_pipeline)
    gone = source(dataset(tmp_path / "gone", 4), small_pipeline)
    live.keys(range(4))
    gone.keys(range(4))
    kept, swept = table_path(live), table_path(gone)
    os.unlink(tmp_path / "gone" / "data.jsonl")
    with mmcache.Cache(tmp_path / "root", memory=0, disk="8MiB") as cache:
        report = cache.gc()
    assert (report.column_files, report.key_tables) == (1, 1)
    assert os.path.exists(kept) and not os.path.exists(swept)
