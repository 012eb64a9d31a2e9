"""``stats``, ``verify`` and ``gc`` on what a root can be and what processes leave behind
(issue 37, H11): a root with a memory tier only, and the reject logs of killed processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest

from mmcache.cache import Cache
from mmcache.cli import main
from mmcache.keys import sample_key
from mmcache.sources.rejects import RejectLog
from mmcache.stores.memory.shm import pid_namespace

FORK = mp.get_context("fork")


@pytest.fixture(autouse=True)
def _own_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gc prunes the node's identity ledger: this test's own, not the user's."""
    monkeypatch.setenv("MMCACHE_IDENTITY_DIR", str(tmp_path / "ledger"))


def _put(cache: Cache, n: int) -> None:
    for i in range(n):
        assert cache.put(sample_key(f"id{i}", "stamp", "fp"), {"x": np.full(500, i, np.uint8)})


def test_a_memory_only_root_is_checked_and_collected(
    cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``Cache(root, disk=None)``: stats, verify and gc said "not an mmcache cache root
    (no disk tier was made)"; the root records its options like any other now."""
    with Cache(cache_root, memory="4MiB", disk=None, ttl="30d") as cache:
        _put(cache, 3)
    assert main(["stats", "--cache", str(cache_root), "--json"]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    assert report["memory"]["items"] == 3 and "disk" not in report
    assert main(["verify", "--cache", str(cache_root)]) == 0
    assert "checked 3 entries in the memory tier: 0 bad" in capsys.readouterr().out
    assert main(["gc", "--cache", str(cache_root), "--older-than", "0s", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expired"] == 3
    with Cache.open_existing(cache_root) as cache:
        assert cache.memory is not None and len(cache.memory) == 0
    recorded = json.loads((cache_root / "cache.json").read_text())
    assert (recorded["memory"], recorded["disk"], recorded["ttl"]) == (4 << 20, None, 30 * 86400)


def test_a_memory_only_open_never_replaces_a_disk_roots_record(cache_root: Path) -> None:
    with Cache(cache_root, memory=0, disk="4MiB", policy="lru") as cache:
        _put(cache, 2)
    before = (cache_root / "cache.json").read_bytes()
    with Cache(cache_root, memory="1MiB", disk=None) as cache:
        assert cache.disk is None
    assert (cache_root / "cache.json").read_bytes() == before  # its disk tier stays seen
    with Cache.open_existing(cache_root, memory=0) as cache:
        assert cache.disk is not None and len(cache.disk) == 2


# ------------------------------------------------------------------------- reject logs


def _make_log_and_die() -> None:
    log = RejectLog()  # kept: a log nobody holds is removed at once by its finalizer
    os.kill(os.getpid(), signal.SIGKILL)  # which never runs now: the log stays
    print(log.path)  # pragma: no cover - never reached


@pytest.fixture
def logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary folder reject logs are made in, this test's own."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _killed_log(logs: Path) -> Path:
    before = list(logs.glob("mmcache-rejects-*"))
    child = FORK.Process(target=_make_log_and_die)
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL
    (log,) = set(logs.glob("mmcache-rejects-*")) - set(before)
    return log


@pytest.mark.parametrize("argv", [["gc", "--all"], ["gc", "--cache", "ROOT"]])
def test_gc_removes_the_reject_log_of_a_killed_process(
    logs: Path, cache_root: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """The soak's leftover: a killed process's log stayed until another process made a
    log, and none may come. gc removes it, and keeps the log of a live process."""
    with Cache(cache_root, memory=0, disk="1MiB"):
        pass
    live = RejectLog()  # this process's, running (made first: a new log sweeps too)
    dead = _killed_log(logs)
    argv = [str(cache_root) if a == "ROOT" else a for a in argv]
    assert main([*argv, "--json"]) == 0
    assert not dead.exists() and os.path.exists(live.path)
    assert json.loads(capsys.readouterr().out)["reject_logs"] == [str(dead)]


def test_a_reject_log_whose_pid_was_reused_is_removed(logs: Path) -> None:
    """The pid of a killed creator, taken by a later process (here: this one), no longer
    keeps its log: the creator's start time is in the name too."""
    here = f"{os.getpid()}-s1-n{pid_namespace()}"  # this pid, started at another time
    reused = logs / f"mmcache-rejects-{here}-abcd1234.jsonl"
    other_container = logs / f"mmcache-rejects-{os.getpid()}-s1-n1-abcd1234.jsonl"
    reused.touch()
    other_container.touch()
    live = RejectLog()  # sweeps the folder, as every new log does
    assert not reused.exists()
    assert other_container.exists()  # another pid namespace's: its pids mean nothing here
    assert os.path.exists(live.path)
