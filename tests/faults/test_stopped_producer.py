"""A job stopped while it produces a sample (SIGSTOP, Ctrl-Z, a suspended job) stalls
the other jobs on its root for about a second, and the wait is said (issue 37, H10).

A process that misses a key another process is producing waits for that process's
claim (:mod:`mmcache.stores.claims`). A stopped holder is alive, so the kernel keeps its
claim: waiters used to wait the whole 30 s timeout, with nothing logged. Now a waiter
looks the holder up after ``notice`` (1 s), warns once naming its pid and the key, and
produces the sample itself (the claims alone: tests/multiproc/test_shared_preparation.py).
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
from mmcache.stores.memory import unlink_store
from mmcache.transforms import ImageSpec
from mmcache.transforms.pipeline import Pipeline

N = 8


# A training job of its own process whose first decode never ends: it says which sample it
# is producing (holding that key's claim) and blocks there.
STUCK_JOB = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from mmcache import Cache, DataLoader, MultimodalDataset
    from mmcache.transforms import ImageSpec
    from mmcache.transforms.pipeline import Pipeline
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
