"""The control plane driven without data: the steps of the 10^8-sample simulation (issue 41).

Each function is one step of what a training job does with a source before and around
its batches, on a :class:`~mmcache.testing.synthetic.SyntheticSource` (ids and stamps, no
bytes), so that what it costs per sample is the control plane's alone:

- :func:`plan_epochs`: a :class:`~mmcache.loader.DataLoader` and the first batch of each
  epoch (the epoch's order, its batches and the loader's memo of them);
- :func:`key_order`: the keys of samples in an epoch's order, as a new run's first epoch
  makes them (stamps, identity text, hash, the source's key memo);
- :func:`save_and_resume`: ``state_dict`` after some batches, a new loader's
  ``load_state_dict`` and its first batch;
- :func:`elastic_resume`: a state saved at one world size resumed at another, with what
  each rank consumed before and is given after (:func:`coverage` counts the samples
  seen twice or never);
- :func:`claim_keys`: the node's production claims (:mod:`mmcache.stores.claims`) taken
  and dropped for keys.

The caller measures (``benchmarks/control_plane.py``: CPU, wall and memory per phase in
a fresh process; ``tests/unit/test_control_plane.py``: traced heap at 10^5). Loaders run
without a cache and without workers: the order, the plan and the state machinery, not
the tiers. Not thread-safe (each call owns the loaders it makes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from mmcache.errors import MmcacheError
from mmcache.hooks import EpochContext, LoaderHook
from mmcache.loader import DataLoader, Distributed
from mmcache.stores.claims import Claims
from mmcache.testing.synthetic import SyntheticSource

#: Called with the name of each step as it ends (a benchmark's clock), or None.
Mark = Callable[[str], None] | None

__all__ = [
    "Coverage",
    "ElasticResume",
    "RemainingPlan",
    "claim_keys",
    "coverage",
    "elastic_resume",
    "key_order",
    "plan_epochs",
    "save_and_resume",
]


def _loader(
    source: SyntheticSource,
    batch_size: int,
    *,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    hooks: tuple[LoaderHook, ...] = (),
) -> DataLoader:
    """A loader of ``source`` as one rank of ``world_size`` sees it: no cache, no workers."""
    return DataLoader(
        source,
        cache=None,
        batch_size=batch_size,
        seed=seed,
        distributed=Distributed(rank=rank, world_size=world_size),
        hooks=hooks,
    )


def _indices(batch: dict[str, Any]) -> npt.NDArray[np.int64]:
    """The dataset indices of a batch's rows (the synthetic source produces each one's)."""
    return np.asarray(batch["index"], dtype=np.int64).reshape(-1)


def plan_epochs(
    source: SyntheticSource, *, batch_size: int, epochs: int = 2, seed: int = 0
) -> DataLoader:
    """A loader whose first ``epochs`` epochs were each begun (their first batch taken):
    each epoch's order planned and remembered as the loader does. Returns the loader."""
    loader = _loader(source, batch_size, seed=seed)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        iterator = iter(loader)
        next(iterator, None)
        del iterator
    return loader


def key_order(source: SyntheticSource, order: npt.NDArray[np.int64], *, batch_size: int) -> int:
    """Key the samples ``order`` (an epoch's order, or part of it) batch by batch, as the
    planner of a new run's first epoch does. Returns the samples keyed."""
    for start in range(0, order.shape[0], batch_size):
        source.key_rows(order[start : start + batch_size])
    return int(order.shape[0])


def save_and_resume(
    source: SyntheticSource, *, batch_size: int, after: int, seed: int = 0, mark: Mark = None
) -> tuple[dict[str, Any], DataLoader, npt.NDArray[np.int64]]:
    """``state_dict`` after ``after`` batches of epoch 0, then a new loader (same world
    size) loaded from it and its first batch: ``(state, new loader, that batch's indices)``.
    ``mark`` is told ``"batches"``, ``"state_dict"``, ``"load_state_dict"`` and
    ``"first batch"`` as each ends."""
    mark = mark or (lambda step: None)
    first = _loader(source, batch_size, seed=seed)
    iterator = iter(first)
    for _ in range(after):
        next(iterator)
    mark("batches")
    state = first.state_dict()
    mark("state_dict")
    del iterator, first
    resumed = _loader(source, batch_size, seed=seed)
    resumed.load_state_dict(state)
    mark("load_state_dict")
    batch = next(iter(resumed))
    mark("first batch")
    return state, resumed, _indices(batch)


class RemainingPlan(LoaderHook):
    """A ``before_epoch`` hook that keeps the batches a rank is given from where it starts
    (its plan of the rest of the epoch: what it will yield, without producing it)."""

    def __init__(self) -> None:
        self.batches: list[npt.NDArray[np.int64]] = []

    def before_epoch(self, ctx: EpochContext) -> None:
        self.batches = list(ctx.batches(ctx.epoch)[ctx.start :])

    def indices(self) -> npt.NDArray[np.int64]:
        """Every index of the remaining batches, in order."""
        if not self.batches:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(self.batches).astype(np.int64, copy=False)


@dataclass
class ElasticResume:
    """What :func:`elastic_resume` saw: the indices the saving ranks consumed (from their
    batches), what each resuming rank is given (its plan, or its batches when walked), and
    the state resumed from."""

    consumed: npt.NDArray[np.int64]
    remaining: list[npt.NDArray[np.int64]]
    state: dict[str, Any]


def elastic_resume(
    source: SyntheticSource,
    *,
    batch_size: int,
    world_from: int,
    world_to: int,
    after: int,
    walk: bool = False,
    seed: int = 0,
    mark: Mark = None,
) -> ElasticResume:
    """Ranks ``0..world_from-1`` each take ``after`` batches of epoch 0 and rank 0 saves the
    state; ranks ``0..world_to-1`` of a new job each load it and take the rest of the epoch.

    ``walk``: each resuming rank yields all its remaining batches (the data path; each
    row's index is what was served); otherwise it takes its first batch, and the rest is
    its plan (:class:`RemainingPlan`), checked to begin with that batch. Loaders are made
    and dropped one at a time (each holds the epoch's order). ``mark`` is told ``"saved"``
    once the first job's ranks are done, then ``"load_state_dict"`` and ``"first batch"``
    (or ``"walked"``) for each resuming rank."""
    mark = mark or (lambda step: None)
    consumed: list[npt.NDArray[np.int64]] = []
    state: dict[str, Any] = {}
    for rank in range(world_from):
        loader = _loader(source, batch_size, seed=seed, rank=rank, world_size=world_from)
        iterator = iter(loader)
        consumed.extend(_indices(next(iterator)) for _ in range(after))
        if rank == 0:
            state = loader.state_dict()
        del iterator, loader
    mark("saved")
    remaining = []
    for rank in range(world_to):
        plan = RemainingPlan()
        loader = _loader(
            source, batch_size, seed=seed, rank=rank, world_size=world_to, hooks=(plan,)
        )
        loader.load_state_dict(state)
        mark("load_state_dict")
        if walk:
            given = [_indices(batch) for batch in loader]
            remaining.append(np.concatenate(given) if given else np.zeros(0, dtype=np.int64))
            mark("walked")
        else:
            first = next(iter(loader), None)
            mark("first batch")
            planned = plan.indices()
            if first is not None and not np.array_equal(
                planned[: len(_indices(first))], _indices(first)
            ):
                raise MmcacheError(
                    f"rank {rank} of {world_to} resumed: its first batch is not the first "
                    "of the plan its before_epoch hook was given (the loader's order and "
                    "its batches disagree)"
                )
            remaining.append(planned)
        del loader, plan
    joined = np.concatenate(consumed) if consumed else np.zeros(0, dtype=np.int64)
    return ElasticResume(joined, remaining, state)


@dataclass(frozen=True)
class Coverage:
    """How often each of ``n`` samples was served over a save and a resume: ``never``
    (not before, not after), ``again`` (consumed before and given again after), and
    ``repeats`` (given twice after: the padding that makes the ranks' parts equal)."""

    never: int
    again: int
    repeats: int


def coverage(n: int, result: ElasticResume) -> Coverage:
    """Count :class:`Coverage` of ``result`` over ``n`` samples (two counters per sample
    while it runs: 16 bytes a sample, and 8 more for each rank's count)."""
    before = np.bincount(result.consumed, minlength=n)
    after = np.zeros(n, dtype=np.int64)
    for part in result.remaining:
        after += np.bincount(part, minlength=n)
    return Coverage(
        never=int(np.count_nonzero((before == 0) & (after == 0))),
        again=int(np.count_nonzero((before > 0) & (after > 0))),
        repeats=int(np.maximum(after - 1, 0).sum()) + int(np.maximum(before - 1, 0).sum()),
    )


def claim_keys(path: str | Path, keys: npt.NDArray[np.uint8]) -> int:
    """Take and drop the node's claim on each of ``keys`` (``uint8 [k, 16]``) through the
    claims of lock file ``path``, as a worker producing each miss does. Returns the claims
    held (a claim the kernel refused is not counted)."""
    claims = Claims(str(path))
    held = 0
    for row in keys:
        claim = claims.acquire(row.tobytes(), wait=False)
        if claim is not None and claim.fd >= 0:
            held += 1
        if claim is not None:
            claim.release()
    return held
