"""The loader's hook points: after every batch is assembled (both ways a batch is made)
and before each epoch begins."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.errors import ConfigError
from mmcache.loader import BatchContext, DataLoader, EpochContext, LoaderHook
from mmcache.loader.hooks import Hooks
from mmcache.synth import make_dataset
from mmcache.transforms.pipeline import Pipeline


def _epoch(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return list(loader)


class Recorder(LoaderHook):
    """Records what it is told; flips the images of a seeded half of the samples."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.contexts: list[BatchContext] = []
        self._lock = threading.Lock()  # after_assemble runs on two threads

    def before_epoch(self, ctx: EpochContext) -> None:
        with self._lock:
            self.events.append(("epoch", ctx.epoch, ctx.start, ctx.num_batches))
            assert [len(b) for b in ctx.batches(ctx.epoch)][:1] != []

    def after_assemble(self, batch: dict[str, Any], ctx: BatchContext) -> dict[str, Any]:
        with self._lock:
            self.events.append(("batch", ctx.epoch, ctx.batch))
            self.contexts.append(ctx)
        # A seeded per-sample transform: a function of (seed, epoch, index) only.
        flip = [
            bool(np.random.default_rng([ctx.seed, ctx.epoch, int(i)]).integers(2))
            for i in ctx.indices
        ]
        image = batch["image"].clone()
        image[flip] = image[flip].flip(-1)
        batch["image"] = image
        batch["flipped"] = flip
        return batch


@pytest.fixture
def own_data(tmp_path: Path) -> Path:
    return make_dataset(tmp_path / "data", 40, seed=7)


def test_hooks_see_every_batch_of_both_assembly_paths_and_each_epoch_first(
    own_data: Path, small_pipeline: Pipeline, cache_root: Path
) -> None:
    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    ref_hook = Recorder()
    ref = DataLoader(ds, cache=None, batch_size=6, seed=2, hooks=[ref_hook])
    want = {e: _epoch(ref, e) for e in range(4)}
    hook = Recorder()
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(
            ds,
            cache=cache,
            batch_size=6,
            seed=2,
            num_workers=2,
            persistent_workers=True,
            hooks=[hook],
        )
        for e in range(4):  # cold, then planned by the workers or guessed
            got = _epoch(loader, e)
            assert len(got) == len(want[e])
            for x, y in zip(got, want[e], strict=True):
                assert x["id"] == y["id"] and x["flipped"] == y["flipped"]
                assert torch.equal(x["image"], y["image"])  # same transform, cache or not
        assert 2 in loader._warm.guessed  # epoch 2 was gathered from learnt keys
        loader.close()
    guessed = {c.epoch for c in hook.contexts if c.guessed}
    planned = {c.epoch for c in hook.contexts if not c.guessed}
    assert 0 in planned and 2 in guessed  # both assembly paths ran the hook
    for c in hook.contexts:
        assert (c.seed, c.rank, c.world_size) == (2, 0, 1)
        assert ds.ids(c.indices) == [ds.sample_id(int(i)) for i in c.indices]
    # Each epoch's before_epoch comes before any of its batches; every batch seen once.
    for e in range(4):
        mine = [ev for ev in hook.events if ev[1] == e]
        assert mine[0] == ("epoch", e, 0, len(want[e]))
        assert sorted(ev[2] for ev in mine[1:]) == list(range(len(want[e])))


def test_before_epoch_is_told_a_resumed_start_and_rows_match_the_batch(
    tiny_data: Path, small_pipeline: Pipeline
) -> None:
    ds = MultimodalDataset(tiny_data, pipeline=small_pipeline)
    hook = Recorder()
    loader = DataLoader(ds, cache=None, batch_size=10, seed=1, hooks=[hook])
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    del it
    again = DataLoader(ds, cache=None, batch_size=10, seed=1, hooks=[hook])
    again.load_state_dict(state)
    hook.events.clear()
    rest = list(again)
    assert hook.events[0] == ("epoch", 0, 2, 5)
    assert len(rest) == 3
    for batch, ctx in zip(rest, hook.contexts[-3:], strict=True):
        assert batch["id"] == ds.ids(ctx.indices)


def test_hooks_are_checked() -> None:
    with pytest.raises(ConfigError, match="before_epoch or after_assemble"):
        Hooks([object()])
    with pytest.raises(ConfigError, match="list"):
        Hooks(LoaderHook())  # type: ignore[arg-type]

    class Bad:
        def after_assemble(self, batch: dict[str, Any], ctx: BatchContext) -> None:
            return None

    hooks = Hooks([Bad()])
    assert hooks and hooks.after
    with pytest.raises(TypeError, match="returned NoneType"):
        hooks.after_assemble({}, BatchContext(0, 0, np.zeros(0, np.int64), 0, 0, 1, False))
    assert not Hooks([LoaderHook()])  # the base class alone does nothing


def test_the_hook_contract_lives_in_the_base_layer() -> None:
    """``mmcache.hooks`` holds the contract (the cluster and the remote prefetcher type
    against it); the loader's old import path names the same classes."""
    import mmcache.hooks as contract
    import mmcache.loader.hooks as old
    from mmcache.cluster.exchange import ClusterExchange
    from mmcache.sources.blobs.prefetch import RemotePrefetch

    for name in ("LoaderHook", "BatchContext", "EpochContext"):
        assert getattr(old, name) is getattr(contract, name)
        assert getattr(contract, name).__module__ == "mmcache.hooks"
    assert issubclass(ClusterExchange, contract.LoaderHook)
    assert issubclass(RemotePrefetch, contract.LoaderHook)
