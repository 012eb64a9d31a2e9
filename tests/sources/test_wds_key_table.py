"""The node's key table over WebDataset shards (issue 41): a new process over unchanged
shards computes no key, and no change to the shards ever serves a key of another sample.

:mod:`mmcache.sources.wds.keyparts`: the table's identity holds the shards in order with
their stamps, the ids' digest, the extensions and ``on_error``. Every key is compared
with the keys of a source without any table (``MMCACHE_COLUMNS_DIR=off``).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mmcache import Pipeline, keys
from mmcache.cache import Cache
from mmcache.loader import DataLoader
from mmcache.sources import identity, keytable
from mmcache.sources.wds import WebDatasetSource
from mmcache.synth import make_image


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's key-table folder (inherited by child processes)."""
    where = tmp_path / "columns"
    monkeypatch.setenv("MMCACHE_COLUMNS_DIR", str(where))
    return where


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards written by the test count as old enough for their stamps to vouch for keys."""
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


def shard(path: Path, names: list[str], caption: str = "a caption", *, jpeg: bool = False) -> Path:
    """A tar of samples ``names``: an image (a few bytes, or a small JPEG) and a caption each."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for j, name in enumerate(names):
            image = io.BytesIO()
            if jpeg:
                make_image(j).save(image, format="JPEG")
            else:
                image.write(f"image {name}".encode())
            for ext, data in (("jpg", image.getvalue()), ("txt", f"{caption} {name}".encode())):
                info = tarfile.TarInfo(f"{name}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    path.write_bytes(buf.getvalue())
    return path


def three_shards(root: Path) -> list[str]:
    """Shards a (3 samples), b (4) and c (2): their paths."""
    root.mkdir(parents=True, exist_ok=True)
    sizes = {"a": 3, "b": 4, "c": 2}
    return [str(shard(root / f"{s}.tar", [f"{s}{j}" for j in range(k)])) for s, k in sizes.items()]


def all_keys(paths: list[str], pipeline: Pipeline) -> list[bytes]:
    src = WebDatasetSource(paths, pipeline=pipeline)
    return src.keys(range(len(src)))


def plain_keys(
    paths: list[str], pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> list[bytes]:
    """The keys of a source that has no key table (every key computed here)."""
    with monkeypatch.context() as m:
        m.setenv("MMCACHE_COLUMNS_DIR", "off")
        src = WebDatasetSource(paths, pipeline=pipeline)
        assert src.key_table(5) is None
        return src.keys(range(len(src)))


def table_path(paths: list[str], pipeline: Pipeline) -> str:
    table = WebDatasetSource(paths, pipeline=pipeline).key_table(5)
    assert isinstance(table, keytable.KeyTable)
    return table.path


@pytest.mark.usefixtures("folder", "settled")
def test_a_new_source_over_unchanged_shards_computes_no_key(
    tmp_path: Path, hashed: list[int], small_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = three_shards(tmp_path / "shards")
    first = all_keys(paths, small_pipeline)
    assert hashed[0] == 9
    assert all_keys(paths, small_pipeline) == first  # a new run: its own process state
    assert hashed[0] == 9  # none computed again
    assert first == plain_keys(paths, small_pipeline, monkeypatch)


_CHILD = """
import json, sys
from mmcache import keys
from mmcache.sources import identity
from mmcache.cache import Cache
from mmcache.loader import DataLoader
from mmcache.sources.wds import WebDatasetSource
from mmcache.synth import make_image
from mmcache.transforms.pipeline import Pipeline
from mmcache.transforms import ImageSpec, TextSpec
identity.RACY_SECONDS = -1.0
calls = [0]
real = keys.sample_key
def counted(*a):
    calls[0] += 1
    return real(*a)
keys.sample_key = counted
pipe = Pipeline(image=ImageSpec(size=64), text=TextSpec(sys.argv[1], max_length=16))
src = WebDatasetSource(sys.argv[2:], pipeline=pipe)
got = [k.hex() for k in src.keys(range(len(src)))]
print(json.dumps({"hashed": calls[0], "keys": got}))
"""


def _child(paths: list[str], tokenizer_json: Path) -> dict[str, object]:
    """What :data:`_CHILD` printed in a new interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    argv = [sys.executable, "-c", _CHILD, str(tokenizer_json), *paths]
    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, check=True)
    got: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return got


@pytest.mark.usefixtures("folder")
def test_a_second_process_computes_no_key(tmp_path: Path, tokenizer_json: Path) -> None:
    paths = three_shards(tmp_path / "shards")
    first = _child(paths, tokenizer_json)
    second = _child(paths, tokenizer_json)
    assert first["hashed"] == 9
    assert second == {"hashed": 0, "keys": first["keys"]}


@pytest.mark.usefixtures("folder", "settled")
@pytest.mark.parametrize("change", ["fewer", "more", "removed", "added"])
def test_shifted_indices_never_serve_a_wrong_key(
    tmp_path: Path,
    hashed: list[int],
    small_pipeline: Pipeline,
    monkeypatch: pytest.MonkeyPatch,
    change: str,
) -> None:
    """Shard a rewritten with fewer or more samples, removed, or one added before it: the
    numbers of b's and c's samples shift while their own stamps stay the same."""
    paths = three_shards(tmp_path / "shards")
    all_keys(paths, small_pipeline)
    old = table_path(paths, small_pipeline)
    if change == "fewer":
        shard(Path(paths[0]), ["a0", "a2"])
    elif change == "more":
        shard(Path(paths[0]), ["a0", "a1", "a2", "a3"])
    elif change == "removed":
        os.unlink(paths.pop(0))
    else:
        paths.insert(0, str(shard(tmp_path / "shards" / "0.tar", ["z0", "z1"])))
    want = plain_keys(paths, small_pipeline, monkeypatch)
    hashed[0] = 0
    assert all_keys(paths, small_pipeline) == want
    assert hashed[0] == len(want)  # another table: every key made again, none served
    new = table_path(paths, small_pipeline)
    assert new != old
    assert all_keys(paths, small_pipeline) == want
    assert hashed[0] == len(want)  # the new table serves the next source
    if change != "added":  # a watched shard changed or went: the old table is swept
        assert not os.path.exists(old)


@pytest.mark.usefixtures("folder", "settled")
def test_a_changed_caption_gets_a_new_key(
    tmp_path: Path, hashed: list[int], small_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = three_shards(tmp_path / "shards")
    before = all_keys(paths, small_pipeline)
    st = os.stat(paths[1])
    shard(Path(paths[1]), ["b0", "b1", "b2", "b3"], caption="a dog....")  # the same size
    os.utime(paths[1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # never the same tick
    after = all_keys(paths, small_pipeline)
    assert after == plain_keys(paths, small_pipeline, monkeypatch)
    assert all(a != b for a, b in zip(after[3:7], before[3:7], strict=True))
    assert after[:3] == before[:3] and after[7:] == before[7:]
    hashed[0] = 0
    assert all_keys(paths, small_pipeline) == after
    assert hashed[0] == 0


@pytest.mark.usefixtures("folder", "settled")
def test_other_extensions_or_on_error_are_another_table(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    paths = three_shards(tmp_path / "shards")
    tables = {
        WebDatasetSource(paths, pipeline=small_pipeline, **options).key_table(5)
        for options in ({}, {"text_exts": ("caption", "txt")}, {"on_error": "skip"})
    }
    assert len({t.path for t in tables if isinstance(t, keytable.KeyTable)}) == 3


@pytest.mark.usefixtures("folder", "settled")
def test_a_damaged_row_is_keyed_again(
    tmp_path: Path, hashed: list[int], small_pipeline: Pipeline
) -> None:
    paths = three_shards(tmp_path / "shards")
    want = all_keys(paths, small_pipeline)
    path, width = table_path(paths, small_pipeline), 8 * (3 + 5)
    with open(path, "r+b") as f:
        f.seek(keytable.HEADER + 4 * width)
        row = bytearray(f.read(width))
        row[3] ^= 1
        f.seek(keytable.HEADER + 4 * width)
        f.write(row)
    hashed[0] = 0
    assert all_keys(paths, small_pipeline) == want
    assert hashed[0] == 1


@pytest.mark.usefixtures("folder", "settled")
@pytest.mark.parametrize("planted", ["symlink", "open to others"])
def test_a_refused_table_file_is_made_again(
    tmp_path: Path, hashed: list[int], small_pipeline: Pipeline, planted: str
) -> None:
    paths = three_shards(tmp_path / "shards")
    want, path = all_keys(paths, small_pipeline), table_path(paths, small_pipeline)
    elsewhere = tmp_path / "elsewhere.keys"
    os.replace(path, elsewhere)
    if planted == "symlink":
        os.symlink(elsewhere, path)
    else:
        os.replace(elsewhere, path)
        os.chmod(path, 0o666)
    hashed[0] = 0
    assert all_keys(paths, small_pipeline) == want
    assert hashed[0] == 9  # nothing read from the refused file
    st = os.lstat(path)
    assert not os.path.islink(path) and not st.st_mode & 0o077


@pytest.mark.usefixtures("folder")
def test_a_young_shard_is_keyed_again(
    tmp_path: Path, hashed: list[int], small_pipeline: Pipeline
) -> None:
    """A shard written within the racy window: a rewrite in the same clock tick could keep
    its every stat field, so its keys are remembered neither in the table nor the memo."""
    paths = three_shards(tmp_path / "shards")
    src = WebDatasetSource(paths, pipeline=small_pipeline)
    src.keys(range(9))
    src.keys(range(9))
    assert hashed[0] == 18


@pytest.mark.usefixtures("folder")
def test_only_the_young_shards_samples_are_keyed_again(
    tmp_path: Path, hashed: list[int], small_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(identity, "RACY_SECONDS", 1.5)
    paths = three_shards(tmp_path / "shards")
    time.sleep(1.6)  # a, b and c settled (b is keyed well within 1.5 s of its rewrite)
    shard(Path(paths[1]), ["b0", "b1", "b2", "b3"], caption="another")  # b young again
    src = WebDatasetSource(paths, pipeline=small_pipeline)
    order = [8, 4, 0, 5, 3, 1, 7, 2, 6]  # shards interleaved in the batch
    first = src.keys(order)
    assert hashed[0] == 9
    assert WebDatasetSource(paths, pipeline=small_pipeline).keys(order) == first
    assert hashed[0] == 9 + 4  # b's samples only


@pytest.mark.usefixtures("folder", "settled")
@pytest.mark.parametrize("workers", [0, 2])
def test_a_loaders_epoch_fills_the_table(
    tmp_path: Path, cache_root: Path, hashed: list[int], small_pipeline: Pipeline, workers: int
) -> None:
    """The loader asks a source for a table of file stamps (4 words) for its learnt keys:
    a WDS source has none of that width, and keeps its own (5 words) for its keys."""
    root = tmp_path / "shards"
    root.mkdir()
    paths = [str(shard(root / f"{s}.tar", [f"{s}{j}" for j in range(4)], jpeg=True)) for s in "ab"]
    src = WebDatasetSource(paths, pipeline=small_pipeline)
    with Cache(cache_root, memory="32MiB", disk=None) as cache:
        for _ in DataLoader(src, cache=cache, batch_size=4, num_workers=workers):
            pass
    hashed[0] = 0
    assert WebDatasetSource(paths, pipeline=small_pipeline).keys(range(8))
    assert hashed[0] == 0
    assert src.key_table(4) is None
