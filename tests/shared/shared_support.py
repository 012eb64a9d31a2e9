"""Shared pieces of the shared-tier tests: a node (its own cache root) over a share, one
epoch's batches and stats, and bitwise equality of two runs."""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.shared import SharedTier
from mmcache.stats import EpochStats

FIELDS = ("image", "input_ids", "attention_mask")


@contextlib.contextmanager
def node(root: Path, shared: str | SharedTier | None, **kw: Any) -> Iterator[Cache]:
    """A cache of its own (memory and disk tiers: another node) over ``shared``; its
    shared-memory segments are removed afterwards."""
    kw.setdefault("memory", "32MiB")
    kw.setdefault("disk", "256MiB")
    cache = Cache(root, shared=shared, temporary=True, **kw)
    try:
        yield cache
    finally:
        cache.close()
        from mmcache.stores.memory import store_dir

        for path in glob.glob(f"{store_dir()}/mmcache-{cache.memory_name}*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def epoch(
    dataset: MultimodalDataset, cache: Cache | None, *, workers: int = 0, **kw: Any
) -> tuple[list[dict[str, Any]], EpochStats]:
    """One epoch's batches (shuffled, seed 3) and its stats; the loader is closed."""
    with DataLoader(
        dataset, cache=cache, batch_size=8, shuffle=True, seed=3, num_workers=workers, **kw
    ) as loader:
        batches = list(loader)
        stats = loader.stats().epochs[-1]
    return batches, stats


def same_batches(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """Assert two runs' batches hold the same samples, bit for bit."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"]
        for name in FIELDS:
            assert torch.equal(x[name], y[name]), name


def packs(share: Path) -> list[str]:
    """The committed packs of a local share."""
    return sorted(glob.glob(str(share / "index" / "*.idx")))
