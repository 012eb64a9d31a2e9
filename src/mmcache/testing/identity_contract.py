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
  copies needs; a source copies its own way with :meth:`IdentityContract.copy_dataset`,
  and one whose copies cannot keep their keys says why in
  :attr:`IdentityContract.copy_skip_reason`: the test is skipped with that reason, never
  silently passed);
- a flipped byte in any tier (memory, disk, and the source's own, e.g. the raw-bytes tier
  of remote objects: :meth:`IdentityContract.flip_source_tiers`) is never served: each
  epoch after the flip is served what the source produces, and the damage is counted.

A source whose samples are not one ``image`` each (clips: ``videos``, served as one
tensor per clip) names its field in :attr:`IdentityContract.field` and says how a batch's
values map to its samples in :meth:`IdentityContract.served_values`.

The hostile-input mixin (:mod:`mmcache.testing.hostile`) is meant to sit next to this one.
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from PIL import Image

from mmcache.cache import Cache
from mmcache.loader import DataLoader
from mmcache.sources.base import SampleSource
from mmcache.stores.disk import DiskStore
from mmcache.stores.memory import MemoryStore
from mmcache.testing.store_contract import flip_in_files

__all__ = [
    "IdentityContract",
    "flip_raw_spans",
    "noise_bmp",
    "produced_images",
    "run_epoch",
    "wrong_ids",
]


def noise_bmp(seed: int, side: int = 32) -> bytes:
    """A ``side`` px BMP of seeded random pixels: every seed gives other bytes of the
    same size (what the contract's datasets of "same names and sizes, other bytes" need)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="BMP")
    return buf.getvalue()


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


def flip_raw_spans(raw: Any, spans: Iterable[tuple[str, str, int, int]]) -> int:
    """Flip a byte in the middle of each ``(url, stamp, start, end)`` span that the
    raw-bytes tier ``raw`` (a :class:`~mmcache.sources.blobs.RawTier`) holds, and check
    that each then reads as a miss (its checksum is checked on read); return how many were
    flipped. What a remote source's :meth:`IdentityContract.flip_source_tiers` does."""
    flipped = 0
    for url, stamp, start, end in spans:
        held = raw.get(url, stamp, start, end)
        assert held is not None, f"{url} [{start}, {end}) is not in the raw tier"
        mid = (end - start) // 2
        flip_in_files([str(Path(raw.path) / "data.mdb")], held[mid - 32 : mid + 32])
        assert raw.get(url, stamp, start, end) is None, f"{url}: a flipped byte was read"
        flipped += 1
    return flipped


def produced_images(source: SampleSource, field: str = "image") -> dict[str, torch.Tensor]:
    """What each id's ``field`` (``image`` by default) really is, produced without a cache."""
    return {
        source.sample_id(i): torch.from_numpy(source.produce(i)[field]) for i in range(len(source))
    }


class IdentityContract:
    """Mixin: subclass, set ``__test__ = True``, implement :meth:`write_dataset` and
    :meth:`open_source`; override :meth:`copy_dataset`, :meth:`flip_source_tiers` and
    :attr:`copy_skip_reason` where the defaults (local folders, no tier of its own, copies
    keep their keys) do not fit."""

    __test__ = False
    #: Why a copy of this source's data cannot keep its keys (``None``: it must).
    copy_skip_reason: ClassVar[str | None] = None
    #: The produced field compared with what is served (what a tier holds verbatim).
    field: ClassVar[str] = "image"

    def write_dataset(self, folder: Path, variant: int) -> Path:
        """Write (or rewrite in place) a dataset under ``folder``; return its location.

        Every ``variant`` has the same relative names, sizes and mtimes (restore them),
        and other image bytes."""
        raise NotImplementedError

    def open_source(self, location: Path) -> SampleSource:
        """A source over ``location``, with a pipeline that keeps ``"image"``."""
        raise NotImplementedError

    def copy_dataset(self, folder: Path, copy: Path, location: Path) -> Path:
        """Copy the dataset written under ``folder`` to ``copy`` as ``cp -a`` does (same
        relative names, bytes and mtimes); return the copy's location. Default: the
        folder tree with its mtimes (a remote source copies its objects instead)."""
        shutil.copytree(folder, copy, copy_function=shutil.copy2)
        return copy / location.relative_to(folder)

    def flip_source_tiers(self, source: SampleSource) -> int:
        """Flip a byte of what ``source``'s own tiers hold (after an epoch filled them);
        return how many values were flipped. Default: a source with no tier of its own,
        0."""
        return 0

    def served_values(self, batch: dict[str, Any]) -> list[torch.Tensor]:
        """``batch``'s value of :attr:`field` for each of its ids, in order, in the form
        :func:`produced_images` gives. Default: the batch's rows of ``batch[field]``."""
        return list(batch[self.field])

    def _wrong(self, batches: Sequence[dict[str, Any]], want: dict[str, torch.Tensor]) -> list[str]:
        """As :func:`wrong_ids`, for :attr:`field` through :meth:`served_values`."""
        return [
            sid
            for b in batches
            for sid, value in zip(b["id"], self.served_values(b), strict=True)
            if not torch.equal(value, want[sid])
        ]

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
                want = produced_images(source, self.field)
                loader = DataLoader(source, cache=cache, batch_size=3, seed=1, num_workers=0)
                try:
                    for epoch in (0, 1):
                        wrong += self._wrong(run_epoch(loader, epoch), want)
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
        if self.copy_skip_reason is not None:
            pytest.skip(self.copy_skip_reason)
        location = self.write_dataset(self.identity_root / "a", 0)
        moved = self.copy_dataset(self.identity_root / "a", self.identity_root / "b", location)
        src_a, src_b = self.open_source(location), self.open_source(moved)
        idx = np.arange(len(src_a))
        np.testing.assert_array_equal(src_a.key_rows(idx), src_b.key_rows(idx))

    def test_a_flipped_byte_in_any_tier_is_never_served(self) -> None:
        source = self.open_source(self.write_dataset(self.identity_root / "a", 0))
        want = produced_images(source, self.field)
        needles = [_middle(image) for image in want.values()]
        root = self.identity_root / "flip"
        for memory, disk in (("16MiB", 0), (0, "64MiB")):
            with Cache(root, memory=memory, disk=disk, temporary=True) as cache:
                loader = DataLoader(source, cache=cache, batch_size=3, seed=1, num_workers=0)
                try:
                    assert self._wrong(run_epoch(loader, 0), want) == []
                    tier = cache.memory if memory else cache.disk
                    if isinstance(tier, MemoryStore):
                        files = tier.segment_paths()
                    else:
                        assert isinstance(tier, DiskStore)
                        files = [str(Path(tier.path) / "data.mdb")]
                    for needle in needles:
                        flip_in_files(files, needle)
                    for epoch in (1, 2):  # the damaged entries are produced again, then kept
                        assert self._wrong(run_epoch(loader, epoch), want) == []
                    name = "memory" if memory else "disk"
                    assert cache.stats()[name].corrupt >= 1, "the flips were never read"
                finally:
                    loader.close()
        if self.flip_source_tiers(source):  # produced from the source's own tier again
            again = produced_images(source, self.field)
            assert [sid for sid, image in again.items() if not torch.equal(image, want[sid])] == []


def _middle(image: torch.Tensor) -> bytes:
    """64 bytes from the middle of ``image``: what a tier holds of it verbatim."""
    data = image.numpy().tobytes()
    mid = len(data) // 2
    return data[mid - 32 : mid + 32]
