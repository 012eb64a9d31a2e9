"""``mmcache gc --compact``: the disk tier's free pages go back to the file system,
only while no other process has the tier open."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache.cache import Cache
from mmcache.cli import main
from mmcache.errors import CacheError
from mmcache.stores.disk import DiskStore

_HOLD = (
    "import sys\n"
    "from mmcache.stores.disk import DiskStore\n"
    "store = DiskStore(sys.argv[1], capacity='64MiB')\n"
    "print('open', flush=True)\n"
    "sys.stdin.read()\n"
    "store.close()\n"
)


def _shrunk(root: Path) -> None:
    """40 entries of 100 kB written, 35 of them deleted: most pages are free."""
    with Cache(root, memory=0, disk="64MiB") as cache:
        for i in range(40):
            cache.put(f"k{i}", {"x": np.full(100_000, i, dtype=np.uint8)})
        for i in range(35):
            assert cache.delete(f"k{i}")


def _kept(root: Path) -> list[int]:
    with Cache(root, memory=0, disk="64MiB") as cache:
        assert cache.verify().ok
        return [int(s["x"][0]) for i in range(40) if (s := cache.get(f"k{i}")) is not None]


def test_gc_compact_gives_the_free_pages_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    _shrunk(root)
    data = root / "disk" / "data.mdb"
    before = data.stat().st_size
    capsys.readouterr()
    assert main(["gc", "--cache", str(root), "--compact"]) == 0
    assert "disk tier compacted" in capsys.readouterr().out
    after = data.stat().st_size
    assert after < before / 4
    assert _kept(root) == list(range(35, 40))
    assert sorted(os.listdir(root / "disk")) == ["data.mdb", "lock.mdb", "stats.i64"]
    assert data.stat().st_mode & 0o777 == 0o600
    # --json reports the sizes; a second compaction has nothing left to give back
    assert main(["gc", "--cache", str(root), "--compact", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["compact"]
    assert report["before"] == after and report["after"] <= after
    # without --compact the report is as it was
    assert main(["gc", "--cache", str(root), "--json"]) == 0
    assert "compact" not in json.loads(capsys.readouterr().out)


def test_gc_compact_refuses_while_another_process_has_the_tier_open(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    _shrunk(root)
    data = root / "disk" / "data.mdb"
    st = data.stat()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(root / "disk")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        capsys.readouterr()
        assert main(["gc", "--cache", str(root), "--compact"]) == 2
        err = capsys.readouterr().err
        assert "another process has it open" in err and str(root / "disk") in err
        assert (data.stat().st_ino, data.stat().st_size) == (st.st_ino, st.st_size)
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0
    assert main(["gc", "--cache", str(root), "--compact"]) == 0  # now nobody has it open
    assert data.stat().st_size < st.st_size / 4
    assert _kept(root) == list(range(35, 40))


def test_compact_refuses_while_another_store_of_this_process_has_it_open(
    tmp_path: Path,
) -> None:
    root = tmp_path / "cache"
    _shrunk(root)
    with DiskStore(root / "disk", capacity="64MiB") as store:
        other = DiskStore(root / "disk", capacity="64MiB")
        try:
            with pytest.raises(CacheError, match="in use in this process"):
                store.compact()
        finally:
            other.close()
        assert len(store) == 5  # still open and working
        report = store.compact()
        assert report.after < report.before / 4
        assert len(store) == 5 and store.put(bytes(16), b"after")
        assert store.get(bytes(16)) == b"after"


def test_compact_without_a_disk_tier_is_an_error(tmp_path: Path) -> None:
    # (the CLI cannot open such a root at all: it has no cache.json)
    with (
        Cache(tmp_path / "cache", memory=0, disk=None) as cache,
        pytest.raises(CacheError, match="no disk tier to compact"),
    ):
        cache.compact()


_OPEN_WHEN_TOLD = (
    "import sys\n"
    "from mmcache.stores.disk import DiskStore\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "with DiskStore(sys.argv[1], capacity='64MiB') as store:\n"
    "    assert store.put(bytes(16), b'written while compacting')\n"
    "    print(len(store), store.verify(lambda raw: True), flush=True)\n"
)


@pytest.mark.parametrize("extra", [0, 1])
def test_a_process_opening_during_the_swap_waits_and_sees_the_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: int
) -> None:
    """It waits for the lock in its open, then uses a lock file made for the new file.

    The old lock file's transaction id would make it read the new file's empty
    meta page when that id is even (and then write over the cache): ``extra``
    writes cover both parities.
    """
    import time

    from mmcache.stores.disk import maintenance

    root = tmp_path / "cache"
    _shrunk(root)
    opener = subprocess.Popen(
        [sys.executable, "-c", _OPEN_WHEN_TOLD, str(root / "disk")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert opener.stdin is not None and opener.stdout is not None
    assert opener.stdout.readline().strip() == "ready"
    swap = maintenance._swap_compacted

    def slow_swap(path: str, lock_fd: int, **kw: int) -> maintenance.CompactReport:
        opener.stdin.write("go\n")  # type: ignore[union-attr]
        opener.stdin.flush()  # type: ignore[union-attr]
        time.sleep(1.0)  # it is waiting in its open now
        return swap(path, lock_fd, **kw)

    monkeypatch.setattr(maintenance, "_swap_compacted", slow_swap)
    with DiskStore(root / "disk", capacity="64MiB") as store:
        for i in range(extra):
            assert store.put(bytes([i + 1]) * 16, b"one more write transaction")
        report = store.compact()
        out, _ = opener.communicate(timeout=60)
        assert opener.returncode == 0
        assert out.split() == [str(6 + extra), "[]"]  # 5 kept + its own, nothing damaged
        assert report.after < report.before / 4
        assert store.get(bytes(16)) == b"written while compacting"
        for i in range(-1, extra):  # not codec entries: Cache.verify would flag them
            assert store.delete(bytes([i + 1]) * 16)
    assert _kept(root) == list(range(35, 40))


def test_a_lock_file_that_cannot_be_rebuilt_is_emptied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Never the old file's reader table and transaction id: any later open rebuilds it."""
    import lmdb

    from mmcache.stores.disk import maintenance

    root = tmp_path / "cache"
    _shrunk(root)
    real_open = maintenance.open_env

    def no_locked_open(path: str, **kw: Any) -> lmdb.Environment:
        if kw["lock"]:
            raise lmdb.Error("simulated")
        return real_open(path, **kw)

    monkeypatch.setattr(maintenance, "open_env", no_locked_open)
    with DiskStore(root / "disk", capacity="64MiB") as store:
        report = store.compact()  # the store reopens through env.open_env: not patched
        assert report.after < report.before / 4
        assert len(store) == 5
    assert "emptied it" in caplog.text
    assert _kept(root) == list(range(35, 40))
