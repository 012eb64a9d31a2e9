"""What the ``mmcache`` command says about itself and does when its reader goes away:
``--version``, and ``mmcache stats | head`` (issue 37, item 12)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mmcache
from mmcache.cache import Cache
from mmcache.cli import main


def test_version_names_the_release_and_the_copy_that_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out.strip()
    where = os.path.dirname(os.path.abspath(mmcache.__file__))
    assert out.startswith(f"mmcache {mmcache.__version__} from {where} (python ")


def test_python_dash_m_mmcache_runs_the_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mmcache", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"mmcache {mmcache.__version__} from ")


def test_a_reader_that_goes_away_ends_the_command_quietly(cache_root: Path) -> None:
    """``mmcache stats | head``: the pipe's reader is gone before the table is printed.
    Before: a BrokenPipeError traceback, exit 1. Now: nothing on stderr, exit 141 (what a
    shell reports for a command killed by SIGPIPE, as for ``yes | head``)."""
    with Cache(cache_root, memory=0, disk="4MiB") as cache:
        assert cache.disk is not None
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmcache.cli", "stats", "--cache", str(cache_root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader goes away before the child writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert err == "", err
