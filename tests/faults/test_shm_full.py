"""A full ``/dev/shm`` slows the loader down, never stops it; ``memory="auto"`` leaves room
(issue 37: H4).

Each test runs its jobs in a private mount namespace with a small tmpfs on
``/dev/shm`` (``unshare -m``; skipped where that is not permitted), so that torch's
and multiprocessing's shared memory fill it too, not only the memory tier.

- ``/dev/shm`` filled by another program until 0 B, 64 KiB or 1 MiB are left, then a
  loader with crop processes and two persistent workers: it finishes, its batches are
  those of an uncached run, it warns once, and no ``torch_*`` file is left behind.
  Before, it died of ENOSPC: in the epoch gate's semaphores (0 B), torch's worker
  queues (64 KiB), or a crop output buffer (1 MiB, leaving a ``torch_*`` file).
- Three jobs started together, each with ``Cache(its root, memory="auto")``, in an 8
  MiB ``/dev/shm``: their budgets add up to at most the 7/8 of it not left to the
  loaders, all finish with exact batches, and no ``torch_*`` file is left. Before,
  each was given half of the free space (together 1.5 times all of it).
- The same three budgets, in this process over a small tmpfs as the memory tier's
  folder: each counts what the stores opened before it may still take, and a reopened
  root counts the pages it holds as room of its own.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shm_namespace import run_job

from mmcache.cache import Cache
from mmcache.stores.memory import shm as shm_mod

MiB = 1 << 20


@pytest.mark.parametrize("free", [0, 64 << 10, 1 << 20], ids=["0B", "64KiB", "1MiB"])
def test_a_loader_finishes_in_a_full_dev_shm(free: int, tmp_path: Path) -> None:
    result = run_job("full", str(tmp_path / "data"), str(tmp_path), str(free), shm=16 * MiB)
    assert result["same"] and result["batches"] == 12, result
    assert len(result["warnings"]) == 1, result["warnings"]
    assert "/dev/shm" in result["warnings"][0]
    assert result["torch_files"] == [], result


def test_three_jobs_with_memory_auto_at_once(tmp_path: Path) -> None:
    size = 8 * MiB
    args = ("jobs", str(tmp_path / "data"), str(tmp_path), "3", "auto", "128", "96")
    result = run_job(*args, shm=size)
    jobs = result["jobs"]
    assert [j["rc"] for j in jobs] == [0, 0, 0], [j["stderr"] for j in jobs]
    assert all(j["same"] and j["batches"] == 24 for j in jobs), jobs
    budgets = [j["budget"] for j in jobs]
    assert 0 < sum(budgets) <= size * 7 // 8, budgets
    assert result["torch_files"] == [], result


def test_memory_auto_counts_the_budgets_of_other_live_stores(
    tmpfs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 8 * MiB
    monkeypatch.setattr(shm_mod, "SHM_DIR", str(tmpfs("shm", str(size))))
    roots = [tmp_path / f"root{i}" for i in range(3)]
    with contextlib.ExitStack() as opened:
        caches = [opened.enter_context(Cache(r, memory="auto", temporary=True)) for r in roots]
        budgets = [c.memory_budget for c in caches]
        # none of them has filled a page yet: only their declared budgets tell
        assert budgets[0] > 3 * MiB, budgets
        assert 0 < sum(budgets) <= size * 7 // 8, budgets
        assert budgets[1] < budgets[0] and budgets[2] < budgets[1], budgets
        # a reopened root counts its own pages as room: once the others are gone, its
        # budget is what it was, however much it holds
        for cache in caches[1:]:
            cache.close()
        caches[0].put("a sample", {"pixels": np.ones(MiB, dtype=np.uint8)})
        assert caches[0].memory is not None and caches[0].memory.nbytes() > MiB
        with Cache(roots[0], memory="auto", temporary=True) as again:
            assert again.memory_budget == budgets[0]
