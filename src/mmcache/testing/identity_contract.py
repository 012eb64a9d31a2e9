"""The identity part of the source contract (:mod:`mmcache.sources.identity`), as a pytest mixin.

Every source passes it next to :class:`~mmcache.testing.source_contract.SourceContract`::

    class TestMySourceIdentity(IdentityContract):
        __test__ = True

        def write_dataset(self, folder, variant):   # same names, sizes and mtimes per
            ...                                      # variant; other bytes
        def open_source(self, location):
            return MySource(location, pipeline=self.pipeline)

What it checks, each through a :class:`~mmcache.Cache` and a :class:`~mmcache.DataLoader`
where an entry could be served:

- two datasets with the same relative names, sizes and mtimes but other bytes share no key,
  and each one is served its own pixels from one cache root;
- a rewrite in place that restores the sizes and mtimes is fresh at the next epoch;
- a ``cp -a`` copy elsewhere has the same keys (what ``scope="cluster"`` with node-local
  copies needs).

The hostile-input mixin (:mod:`mmcache.testing.hostile`) is meant to sit next to this one.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmcache.cache import Cache
from mmcache.loader import DataLoader
from mmcache.sources.base import SampleSource

__all__ = ["IdentityContract", "produced_images", "run_epoch", "wrong_ids"]


def wrong_ids(batches: Sequence[dict[str, Any]], want: dict[str, torch.Tensor]) -> list[str]:
    """Ids served with an ``image`` that is not ``want[id]`` (what the source produces)."""
    return [
        sid
        for b in batches
        for sid, image in zip(b["id"], b["image"], strict=True)
        if not torch.equal(image, want[sid])
    ]


def run_epoch(loader: Any, epoch: int) -> list[dict[str, Any]]:
    """Every batch of ``loader``'s epoch ``epoch``."""
    loader.set_epoch(epoch)
    return list(loader)


def produced_images(source: SampleSource) -> dict[str, torch.Tensor]:
    """What each id's ``image`` really is, produced without a cache."""
    return {
        source.sample_id(i): torch.from_numpy(source.produce(i)["image"])
        for i in range(len(source))
    }


class IdentityContract:
    """Mixin: subclass, set ``__test__ = True``, implement the two methods below."""

    __test__ = False

    def write_dataset(self, folder: Path, variant: int) -> Path:
        """Write (or rewrite in place) a dataset under ``folder``; return its location.

        Every ``variant`` has the same relative names, sizes and mtimes (restore them),
        and other image bytes."""
        raise NotImplementedError

    def open_source(self, location: Path) -> SampleSource:
        """A source over ``location``, with a pipeline that keeps ``"image"``."""
        raise NotImplementedError

    @pytest.fixture(autouse=True)
    def _identity_root(self, tmp_path: Path) -> None:
        self.identity_root = tmp_path / "identity"

    def _served_wrong(self, sources: Sequence[SampleSource]) -> list[str]:
        """Ids of ``sources`` (in turn, on one cache: memory and disk) served with other
        images than their own over two epochs each."""
        wrong: list[str] = []
        root = self.identity_root / "cache"
        with Cache(root, memory="16MiB", disk="64MiB", temporary=True) as cache:
            for source in sources:
                want = produced_images(source)
                loader = DataLoader(source, cache=cache, batch_size=3, seed=1, num_workers=0)
                try:
                    for epoch in (0, 1):
                        wrong += wrong_ids(run_epoch(loader, epoch), want)
                finally:
                    loader.close()
        return wrong

    def test_equal_names_sizes_and_mtimes_but_other_bytes_share_no_entry(self) -> None:
        a = self.write_dataset(self.identity_root / "a", 0)
        b = self.write_dataset(self.identity_root / "b", 1)
        src_a, src_b = self.open_source(a), self.open_source(b)
        keys_a = {r.tobytes() for r in src_a.key_rows(np.arange(len(src_a)))}
        keys_b = {r.tobytes() for r in src_b.key_rows(np.arange(len(src_b)))}
        assert not keys_a & keys_b, "two datasets of other bytes share keys"
        assert self._served_wrong([src_a, src_b, self.open_source(a)]) == []

    def test_a_rewrite_restoring_sizes_and_mtimes_is_fresh(self) -> None:
        location = self.write_dataset(self.identity_root / "a", 0)
        first = self.open_source(location)
        before = first.key_rows(np.arange(len(first))).copy()
        wrong = self._served_wrong([first])  # its entries stay in the disk tier
        self.write_dataset(self.identity_root / "a", 1)
        again = self.open_source(location)
        after = again.key_rows(np.arange(len(again)))
        assert not {r.tobytes() for r in before} & {r.tobytes() for r in after}
        assert wrong + self._served_wrong([again]) == []

    def test_a_cp_a_copy_has_the_same_keys(self) -> None:
        location = self.write_dataset(self.identity_root / "a", 0)
        copy = self.identity_root / "b"
        shutil.copytree(self.identity_root / "a", copy, copy_function=shutil.copy2)
        moved = copy / location.relative_to(self.identity_root / "a")
        src_a, src_b = self.open_source(location), self.open_source(moved)
        idx = np.arange(len(src_a))
        np.testing.assert_array_equal(src_a.key_rows(idx), src_b.key_rows(idx))
