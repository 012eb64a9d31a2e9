"""The CLI on files that are not regular ones (H8): a FIFO or a device where a manifest, a
shard or a file of a cache root is read.

Opening a FIFO for reading blocks until some writer comes, and ``/dev/zero`` never
ends: before the fix ``inspect`` on either, and ``stats``/``verify``/``gc`` on a root
whose ``cache.json`` a member of a shared root had replaced by a FIFO, hung (or read
``/dev/zero`` until memory ran out). Each command runs here in a forked child under a
deadline and a memory limit; it must exit 2 with one line naming the file and what it is.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mmcache.cache import Cache
from mmcache.cli import main
from mmcache.registry import FingerprintRegistry

FORK = mp.get_context("fork")
#: Far more than any of these commands needs once the modules are imported (they are:
#: the child is forked); a hang runs into it.
DEADLINE_S = 20.0
FP = "0123456789abcdef0123456789abcdef"

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs (os.mkfifo)")


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(run: Callable[[], int], err: str) -> None:
    """In the forked child: stdout to /dev/null, stderr to ``err``, at most 1 GiB more
    address space (the unfixed ``inspect /dev/zero`` reads until memory runs out)."""
    os.setpgrp()
    if _vm_size():
        limit = _vm_size() + (1 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the child exits below
    sys.stderr = open(err, "w")  # noqa: SIM115
    try:
        code = run()
    finally:
        sys.stderr.flush()
    os._exit(code)


def _run_forked(run: Callable[[], int], tmp_path: Path) -> tuple[int, str]:
    """``(exit code, stderr)`` of ``run()`` in a forked child; fails if it is still
    running after :data:`DEADLINE_S` (it is killed, with its process group)."""
    err = tmp_path / f"stderr-{time.monotonic_ns()}"
    child = FORK.Process(target=_child, args=(run, str(err)))
    child.start()
    child.join(DEADLINE_S)
    hung = child.is_alive()
    if hung:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.join(10)
    text = err.read_text() if err.exists() else ""
    assert not hung, f"still running after {DEADLINE_S:.0f} s (a hang); stderr: {text!r}"
    assert child.exitcode is not None
    return child.exitcode, text


def _cli(*argv: str) -> Callable[[], int]:
    return lambda: main(list(argv))


def _one_line_naming(err: str, path: str | Path, what: str) -> None:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(path) in err and what in err, err


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("fifo.jsonl", ()),
        ("fifo.tar", ()),
        ("fifo.parquet", ()),
        ("fifo.json", ("--format", "coco")),
        ("fifo.json", ("--format", "llava")),
    ],
)
def test_inspect_refuses_a_fifo(tmp_path: Path, name: str, options: tuple[str, ...]) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    code, err = _run_forked(_cli("inspect", str(fifo), *options), tmp_path)
    assert code == 2, err
    _one_line_naming(err, fifo, "a FIFO (named pipe), not a regular file")


@pytest.mark.parametrize("options", [(), ("--format", "wds")])
def test_inspect_refuses_dev_zero(tmp_path: Path, options: tuple[str, ...]) -> None:
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    code, err = _run_forked(_cli("inspect", "/dev/zero", *options), tmp_path)
    assert code == 2, err
    _one_line_naming(err, "/dev/zero", "a character device, not a regular file")


def _root_with(cache_root: Path) -> Path:
    """A root with a disk tier, a fingerprint record and a text report folder."""
    with Cache(cache_root, memory=0, disk="4MiB") as cache:
        assert cache.disk is not None
    FingerprintRegistry(cache_root / "fingerprints").touch(FP, "a pipeline", time.time())
    (cache_root / "reports").mkdir()
    return cache_root


@pytest.mark.parametrize("command", ["stats", "verify", "gc"])
def test_a_fifo_planted_as_cache_json_is_refused(
    cache_root: Path, tmp_path: Path, command: str
) -> None:
    config = _root_with(cache_root) / "cache.json"
    config.unlink()
    os.mkfifo(config)
    code, err = _run_forked(_cli(command, "--cache", str(cache_root)), tmp_path)
    assert code == 2, err
    _one_line_naming(err, config, "a FIFO (named pipe), not a regular file")
    assert config.is_fifo()  # left for the user to see, not replaced behind them


@pytest.mark.parametrize(
    ("planted", "argv"),
    [
        (f"fingerprints/{FP}.json", ("stats",)),
        (f"reports/text-{FP}.json", ("stats",)),
        (f"fingerprints/{FP}.json", ("gc", "--unused-for", "0s")),
    ],
)
def test_fifos_planted_among_a_roots_records_are_skipped(
    cache_root: Path, tmp_path: Path, planted: str, argv: tuple[str, ...]
) -> None:
    """Records that are a convenience (a fingerprint's description, an SFT length
    report) are skipped when they are not regular files, as unreadable ones are."""
    path = _root_with(cache_root) / planted
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    code, err = _run_forked(_cli(*argv, "--cache", str(cache_root)), tmp_path)
    assert code == 0, err


def test_a_fifo_planted_as_a_key_log_is_not_read(cache_root: Path, tmp_path: Path) -> None:
    registry = FingerprintRegistry(_root_with(cache_root) / "fingerprints")
    os.mkfifo(cache_root / "fingerprints" / f"{FP}.keys")
    code, err = _run_forked(lambda: len(list(registry.keys(FP))), tmp_path)
    assert code == 0, err  # no keys read from it


def test_an_oversized_cache_json_is_refused_unread(cache_root: Path, tmp_path: Path) -> None:
    config = _root_with(cache_root) / "cache.json"
    with open(config, "r+b") as f:  # a sparse 1 TiB "cache.json": never read whole
        f.truncate(1 << 40)
    code, err = _run_forked(_cli("stats", "--cache", str(cache_root)), tmp_path)
    assert code == 2, err
    _one_line_naming(err, config, "over the limit of")
