"""One preparation per node for ``warm``: processes warming the same keys produce each once.

``warm`` reads through :func:`mmcache.readthrough.read_through` with the node's claims
(:mod:`mmcache.stores.claims`), as the loader's workers do: a sample another process is
producing is waited for and taken from the cache. Before, ``warm`` produced unclaimed,
so two warm-ups of one dataset started together decoded every sample twice (and a
warm-up beside a training job decoded what the job's workers were decoding).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support.together import run_together, wait_for_start

COUNT_ENV = "MMCACHE_TEST_WARM_COUNT"


def _counted_image(im: Any) -> np.ndarray:
    """A decode-sized stage (20 ms a sample) that records each call (one line per
    produce, appended: a line is written whole) and first waits for the common start, so
    both warm-ups begin their misses at one instant (:mod:`support.together`)."""
    wait_for_start()
    time.sleep(0.02)
    with open(os.environ[COUNT_ENV], "a") as f:
        f.write(f"{os.getpid()}\n")
    return np.asarray(im.resize((32, 32)))


def _dataset(paths: tuple[str, str]) -> Any:
    import mmcache as mc

    manifest, tokenizer = paths
    pipe = mc.Pipeline(
        image=mc.stage(_counted_image, version="1"), text=mc.TextSpec(tokenizer, max_length=16)
    )
    return mc.MultimodalDataset(manifest, pipeline=pipe)


def _warm_job(paths: tuple[str, str], root: str, barrier: Any, out: Any) -> None:
    """One warm-up of the whole dataset into ``root``; reports its WarmReport."""
    from mmcache.cache import Cache
    from mmcache.warm import warm

    ds = _dataset(paths)
    cache = Cache(root, memory="16MiB", disk="64MiB")
    out.put("ready")
    report = warm(ds, cache, workers=0, rank=0, world_size=1, progress=False)
    out.put(report.as_dict())
    barrier.wait(120)  # nobody closes the memory tier while the other still warms
    cache.close()


@pytest.mark.timeout(300)
def test_two_warmups_of_one_dataset_produce_each_sample_once(
    tiny_data: Path,
    tokenizer_json: Path,
    cache_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = 48
    count = tmp_path / "produced"
    monkeypatch.setenv(COUNT_ENV, str(count))  # for the children
    paths = (str(tiny_data), str(tokenizer_json))
    reports = run_together(_warm_job, (paths, str(cache_root)), 2, tmp_path / "start")
    produced = count.read_text().split()
    print("produced per process", {pid: produced.count(pid) for pid in set(produced)})
    print("reports", reports)
    assert len(produced) == n, f"two warm-ups produced {len(produced)} samples of {n}"
    assert sum(r["produced"] for r in reports) == n
    assert all(r["total"] == n and r["rejected"] == 0 for r in reports)
    assert all(r["present"] + r["produced"] == n for r in reports)
    assert sum(r["waited"] for r in reports) >= 1  # they did meet on a key

    # The entries are what one process alone makes.
    from mmcache.cache import Cache

    ds = _dataset(paths)
    with Cache(cache_root, memory="16MiB", disk="64MiB") as cache:
        for i in range(n):
            got = cache.get(ds.key(i))
            assert got is not None, i
            want = ds.produce(i)
            assert set(got) == set(want)
            for name, arr in want.items():
                np.testing.assert_array_equal(got[name], arr)
