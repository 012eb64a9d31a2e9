"""Load: many processes on one node-shared cache; two jobs with different pipelines.

* Eight processes (four fork, four spawn) mix ``Cache.get``/``put``/``get_or_produce``
  on one cache root for 10 s (``benchmarks/stress.py --seconds 10``; the script runs
  for 60 s by hand): no error, no wrong or lost value, the budgets never exceeded,
  and the whole cache consistent afterwards.
* Two training jobs (one forked, one spawned) with different pipelines (32 px and
  48 px images) run at the same time on one cache root: each gets exactly the
  batches of its own uncached run, and the cache holds both sets of entries.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.transforms import ImageSpec, TextSpec
from mmcache.transforms.pipeline import Pipeline

STRESS = Path(__file__).resolve().parents[2] / "benchmarks" / "stress.py"


@pytest.mark.slow
def test_eight_processes_fork_and_spawn_on_one_cache_for_10_s() -> None:
    proc = subprocess.run(
        [sys.executable, str(STRESS), "--seconds", "10", "--procs", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.stdout, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    final = summary["final"]
    assert summary["errors"] == [] and summary["failed_procs"] == []
    assert summary["wrong"] == 0 and summary["lost"] == 0
    assert summary["budget_violations"] == 0
    assert final["memory_problems"] == [] and final["memory_bytes"] <= final["memory_budget"]
    assert final["disk_totals_recorded"] == final["disk_totals_rebuilt"]
    assert final["verify_bad"] == 0
    # it really was a load: both start methods worked, both tiers served and evicted
    assert summary["starts"] == {"fork": 4, "spawn": 4}
    assert all(n > 100 for n in summary["ops_by_start"].values()), summary["ops_by_start"]
    assert summary["memory_hits"] > 0 and summary["disk_hits"] > 0
    assert summary["keys_put"] == 256
    assert summary["ok"] and proc.returncode == 0


def training_job(job: dict[str, Any], barrier: Any) -> None:
    size, manifest, tokenizer, root = job["size"], job["manifest"], job["tokenizer"], job["root"]
    pipe = Pipeline(image=ImageSpec(size=size), text=TextSpec(tokenizer, max_length=16))
    ds = MultimodalDataset(manifest, pipeline=pipe)
    reference = []
    for epoch in range(2):
        loader = DataLoader(ds, cache=None, batch_size=8, seed=size)
        loader.set_epoch(epoch)
        reference += [(b["id"], b["image"], b["input_ids"]) for b in loader]
    cache = Cache(root, memory="4MiB", disk="16MiB", policy="lru")
    loader = DataLoader(ds, cache=cache, batch_size=8, seed=size, num_workers=1)
    barrier.wait(60)  # both jobs train at the same time
    same = True
    got = 0
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            ids, image, input_ids = reference[got]
            got += 1
            same &= batch["id"] == ids
            same &= torch.equal(batch["image"], image) and torch.equal(
                batch["input_ids"], input_ids
            )
    stats = loader.stats()
    cache.close()
    Path(job["out"]).write_text(
        json.dumps(
            {
                "same": bool(same),
                "batches": got,
                "expected": len(reference),
                "hits": [e.hits for e in stats.epochs],
                "shape": list(reference[0][1].shape),
            }
        )
    )


@pytest.mark.slow
def test_two_jobs_with_different_pipelines_share_one_root(
    cache_root: Path, tiny_data: Path, tokenizer_json: Path, tmp_path: Path
) -> None:
    barrier = mp.get_context("spawn").Barrier(2)
    jobs = []
    for size, method in ((32, "fork"), (48, "spawn")):
        out = tmp_path / f"job-{size}.json"
        job = {
            "size": size,
            "manifest": str(tiny_data),
            "tokenizer": str(tokenizer_json),
            "root": str(cache_root),
            "out": str(out),
        }
        p = mp.get_context(method).Process(target=training_job, args=(job, barrier))
        p.start()
        jobs.append((size, p, out))
    for _, p, _ in jobs:
        p.join(180)
        if p.exitcode is None:
            p.kill()
            p.join()
    for size, p, out in jobs:
        assert p.exitcode == 0, f"job {size} failed"
        result = json.loads(out.read_text())
        assert result["shape"] == [8, 3, size, size]
        assert result["same"] and result["batches"] == result["expected"] == 12
        assert result["hits"][1] == 48  # the second epoch came from the cache
    with Cache(cache_root, memory="4MiB", disk="16MiB", policy="lru") as cache:
        assert cache.disk is not None and cache.memory is not None
        assert len(cache.disk) == 2 * 48  # both jobs' entries, side by side
        assert cache.memory.check() == []  # type: ignore[attr-defined]
        assert cache.verify().ok
