"""A producer stopped while it holds a claim (SIGSTOP, Ctrl-Z, a suspended job) stalls
nobody for long, and the wait is said (issue 37, H10).

A process that misses a key another process is producing waits for that process's
claim (:mod:`mmcache.stores.claims`). A stopped holder is alive, so the kernel keeps its
claim: waiters used to wait the whole 30 s timeout, with nothing logged. Now a waiter
looks the holder up after ``notice`` (1 s), warns once naming its pid and the key, and
produces the sample itself; a running holder is still waited for.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.pipeline import ImageSpec, Pipeline
from mmcache.stores.claims import Claims, claim_holders
from mmcache.stores.memory import unlink_store

KEY = b"s" * 16
N = 8


def _holder(path: Path) -> subprocess.Popen[str]:
    """A process that claims KEY on ``path``, says so, and sleeps until killed."""
    code = (
        "import time\n"
        "from mmcache.stores.claims import Claims\n"
        f"c = Claims({str(path)!r}).acquire({KEY!r})\n"
        "assert c is not None and c.fd >= 0\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


def _end(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait()


def test_a_stopped_holder_is_named_and_not_waited_for(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "lock"
    path.touch()
    proc = _holder(path)
    try:
        assert claim_holders(str(path), Claims.slot(KEY)) == [(proc.pid, "S")]
        os.kill(proc.pid, signal.SIGSTOP)
        caplog.set_level(logging.WARNING, logger="mmcache.stores.claims")
        t0 = time.monotonic()
        claim = Claims(str(path)).acquire(KEY)  # the default 30 s timeout
        waited = time.monotonic() - t0
        assert claim is not None and claim.fd == -1 and claim.waited  # a pass: produce it
        assert waited < 10, waited  # was the whole 30 s timeout
        (warning,) = [r.getMessage() for r in caplog.records]
        assert f"pid {proc.pid}" in warning and KEY.hex() in warning and "stopped" in warning
    finally:
        _end(proc)


def test_a_running_holder_is_waited_for_then_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "lock"
    path.touch()
    proc = _holder(path)
    try:
        caplog.set_level(logging.WARNING, logger="mmcache.stores.claims")
        t0 = time.monotonic()
        claim = Claims(str(path), timeout=1.5, notice=0.2).acquire(KEY)
        assert claim is not None and claim.fd == -1
        assert time.monotonic() - t0 >= 1.5  # a running producer is not cut short
        (warning,) = [r.getMessage() for r in caplog.records]
        assert f"pid {proc.pid} (state S)" in warning and KEY.hex() in warning
        caplog.clear()
        free = Claims(str(path), notice=0.0).acquire(b"f" * 16)  # another key: no wait
        assert free is not None and free.fd >= 0 and not free.waited
        free.release()
        assert caplog.records == []
    finally:
        _end(proc)


# A training job of its own process whose first decode never ends: it says which sample it
# is producing (holding that key's claim) and blocks there.
STUCK_JOB = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from mmcache import Cache, DataLoader, MultimodalDataset
    from mmcache.pipeline import ImageSpec, Pipeline
    ds = MultimodalDataset(Path(sys.argv[1]), pipeline=Pipeline(image=ImageSpec(size=32)))
    def stuck(index):
        print(index, flush=True)
        time.sleep(600)
    ds.produce = stuck
    list(DataLoader(ds, cache=Cache(sys.argv[2], memory="4MiB", disk=None), batch_size=4))
    """
)


def test_a_job_is_not_stalled_by_another_job_stopped_mid_decode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from mmcache.synth import make_dataset

    manifest = make_dataset(tmp_path / "data", N, seed=5)
    root = tmp_path / "cache"
    other = subprocess.Popen(
        [sys.executable, "-c", STUCK_JOB, str(manifest), str(root)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert other.stdout is not None
    try:
        index = int(other.stdout.readline())  # it holds this sample's claim now
        os.kill(other.pid, signal.SIGSTOP)
        ds = MultimodalDataset(manifest, pipeline=Pipeline(image=ImageSpec(size=32)))
        caplog.set_level(logging.WARNING, logger="mmcache")
        with Cache(root, memory="4MiB", disk=None) as cache:
            loader = DataLoader(ds, cache=cache, batch_size=4, num_workers=0)
            t0 = time.monotonic()
            seen = [i for batch in loader for i in batch["id"]]
            took = time.monotonic() - t0
            assert sorted(seen) == sorted(ds.ids(range(N)))
            assert took < 15, took  # was 30 s more, on the stopped job's sample
            epoch = loader.stats().epochs[0]
            assert epoch.misses == N  # each decoded here, the stuck one too
            unlink_store(cache.memory_name)
        stalls = [r.getMessage() for r in caplog.records if r.name == "mmcache.stores.claims"]
        assert len(stalls) == 1, stalls
        assert f"pid {other.pid}" in stalls[0] and ds.key(index).hex() in stalls[0]
    finally:
        os.kill(other.pid, signal.SIGCONT)
        other.kill()
        other.wait()
