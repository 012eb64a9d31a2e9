"""Where WebDataset member indexes live (never outside the data or the cache root) and
their removal by ``mmcache gc``."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from mmcache.cache import Cache
from mmcache.cli import main
from mmcache.dataset import open_source
from mmcache.sources.wds import WebDatasetSource, write_shards
from mmcache.sources.wds.home import INDEX_FOLDER, index_home
from mmcache.sources.wds.tablefile import SUFFIX
from mmcache.synth import make_dataset
from mmcache.transforms.pipeline import Pipeline


@pytest.fixture
def shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    # an empty home: the old default wrote to $XDG_CACHE_HOME/mmcache/wds-index
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    manifest = make_dataset(tmp_path / "data", 9, seed=3)
    return write_shards(manifest, tmp_path / "shards", per_shard=3)


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def test_default_index_is_kept_beside_the_shards_in_a_private_folder(
    shards: list[Path], small_pipeline: Pipeline, tmp_path: Path
) -> None:
    src = WebDatasetSource(shards, pipeline=small_pipeline)
    sniffed = open_source(str(tmp_path / "shards" / "*.tar"), pipeline=small_pipeline)
    assert len(src) == len(sniffed) == 9
    folder = shards[0].parent / f".mmcache-index-u{os.geteuid()}"
    assert len(list(folder.glob("*" + SUFFIX))) == 3
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert _files(tmp_path / "xdg") == [] and _files(tmp_path / "home") == []


def test_a_folder_another_user_could_write_is_never_used(
    shards: list[Path], small_pipeline: Pipeline, tmp_path: Path
) -> None:
    folder = shards[0].parent / f".mmcache-index-u{os.geteuid()}"
    folder.mkdir()
    folder.chmod(0o777)  # planted, or made by hand: indexes there could steer our reads
    assert len(WebDatasetSource(shards, pipeline=small_pipeline)) == 9
    assert list(folder.iterdir()) == []
    assert _files(tmp_path / "xdg") == [] and _files(tmp_path / "home") == []


def test_remote_shards_keep_their_index_beside_the_raw_tier(tmp_path: Path) -> None:
    raw = tmp_path / "cache" / "raw"
    assert index_home("s3://bucket/00000.tar", raw_path=str(raw)) == str(
        tmp_path / "cache" / INDEX_FOLDER
    )
    assert index_home("s3://bucket/00000.tar", raw_path=None) is None


def test_gc_removes_the_indexes_of_shards_gone_or_changed(
    shards: list[Path], small_pipeline: Pipeline, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    Cache(root, memory=0, disk="1MiB").close()
    idx = root / INDEX_FOLDER
    WebDatasetSource(shards, pipeline=small_pipeline, index_dir=idx)
    kept = {p.name for p in idx.glob("*" + SUFFIX)}
    assert len(kept) == 3
    (idx / ".tmp-dead.json").write_text("{")  # a crashed writer's leftover...
    os.utime(idx / ".tmp-dead.json", (0, 0))  # ...from long ago
    shards[0].unlink()
    st = shards[1].stat()
    written = max(p.stat().st_mtime_ns for p in idx.glob("*" + SUFFIX))
    for _ in range(1000):  # rewritten, its mtime restored (file times have coarse ticks)
        shards[1].write_bytes(shards[1].read_bytes())
        os.utime(shards[1], ns=(st.st_atime_ns, st.st_mtime_ns))
        if shards[1].stat().st_ctime_ns > written:
            break
        time.sleep(0.01)
    assert main(["gc", "--cache", str(root)]) == 0
    assert "3 stale WebDataset member indexes" in capsys.readouterr().out
    left = sorted(p.name for p in idx.iterdir())
    assert len(left) == 1 and left[0] in kept
    again = WebDatasetSource(shards[2], pipeline=small_pipeline, index_dir=idx)
    assert len(again) == 3 and sorted(p.name for p in idx.iterdir()) == left
