"""Writers of a share in other processes: a writer killed with SIGKILL at any moment while
publishing leaves the share readable and correct, and two writers at once never conflict."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from shared_writer_child import entry, key

from mmcache.shared import SharedTier

CHILD = Path(__file__).with_name("shared_writer_child.py")


def spawn(
    share: Path | str,
    spool: Path,
    first: int,
    count: int,
    repeat: int,
    *,
    options: dict[str, Any] | None = None,
) -> subprocess.Popen[str]:
    """A writer process (``shared_writer_child.py``) of entries ``first..first+count``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env["SHARE_OPTIONS"] = json.dumps(options or {})
    args = [sys.executable, str(CHILD), str(share), str(spool), str(first), str(count), str(repeat)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env)


def check(share: Path | str, options: dict[str, Any] | None = None) -> set[int]:
    """Every entry a fresh reader finds is whole and the one its writer wrote; returns them."""
    reader = SharedTier(share, storage_options=options, publish=False)
    try:
        found = set()
        keys = list(reader.keys())
        reader.fetch_ahead(keys)
        for k in keys:
            i = int.from_bytes(k, "big")
            assert reader.get(k) == entry(i), i
            found.add(i)
        return found
    finally:
        reader.close()


def test_a_writer_killed_while_publishing_leaves_the_share_correct(tmp_path, caplog):
    share, spool = tmp_path / "share", tmp_path / "spool"
    seen: set[int] = set()
    for delay in (0.0, 0.03, 0.11, 0.29):
        child = spawn(share, spool, 0, 400, 0)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        with caplog.at_level(logging.WARNING):
            found = check(share)
        assert found >= seen and found  # what was committed stays, and reads back whole
        seen = found
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # the killed writers' spools are swept by the next writer of the folder
    SharedTier(share, spool_dir=spool, linger=0).put(key(10**6), entry(10**6))
    left = [p for p in spool.iterdir() if p.name.startswith("mmcache-pack-")]
    assert len(left) == 1  # the new writer's own open pack only


def test_two_writers_at_once(tmp_path):
    share, spool = tmp_path / "share", tmp_path / "spool"
    # overlapping ranges: both publish 100..149; each publishes its packs under its own names
    a, b = spawn(share, spool, 0, 150, 1), spawn(share, spool, 100, 150, 1)
    for child in (a, b):
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0 and out.strip().endswith("done")
    assert check(share) == set(range(250))


@pytest.mark.parametrize("linger", [0.2])
def test_an_idle_open_pack_is_committed_after_linger(tmp_path, linger):
    """Persistent DataLoader workers never flush between epochs: their open pack is
    committed once no entry came for ``linger`` seconds."""
    share = tmp_path / "share"
    writer = SharedTier(share, linger=linger, spool_dir=tmp_path / "spool")
    reader = SharedTier(share, publish=False, refresh=0)
    try:
        writer.put(key(1), entry(1))
        assert reader.get(key(1)) is None
        deadline = time.monotonic() + 10
        while reader.get(key(1)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reader.get(key(1)) == entry(1)
    finally:
        writer.close()
        reader.close()
