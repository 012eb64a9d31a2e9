"""What the loader does for a mixture (:class:`mmcache.Mixture`): each row's part, the
counts per part, and the mixture a resumed state was saved with.

A mixture declares :class:`~mmcache.sources.capabilities.DrawsEpochs`; for such a source
the loader

- draws each epoch's samples through the source's draw (the sampler's ``draw``);
- names each row's part in every batch (:class:`PartHook`, the first hook: padding and
  packing then keep ``part`` beside ``id``);
- counts samples, hits, misses and rejects per part (:class:`PartTally`, fed by the
  epoch counter with each batch's indices);
- records the mixture in ``state_dict()`` and refuses a state of another mixture,
  naming the part that changed (:func:`check_mixture_state`).

Thread safety: :class:`PartHook` is stateless; :class:`PartTally` is updated under the
epoch counter's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mmcache.checks import shown
from mmcache.errors import ConfigError
from mmcache.hooks import BatchContext, LoaderHook
from mmcache.sources.capabilities import DrawsEpochs
from mmcache.stats import PartStats

__all__ = [
    "STATE_KEY",
    "PartHook",
    "PartTally",
    "check_mixture_state",
    "mixture_state",
    "new_samples_each_epoch",
]

#: The key of a loader state that holds the mixture it was saved with.
STATE_KEY = "mixture"


class PartHook(LoaderHook):
    """Adds ``part`` to every batch: the name of each row's part (a list of str)."""

    def __init__(self, source: DrawsEpochs) -> None:
        self._names = source.part_names
        self._part_of = source.part_of

    def after_assemble(self, batch: dict[str, Any], ctx: BatchContext) -> dict[str, Any]:
        names = self._names
        batch["part"] = [names[k] for k in self._part_of(ctx.indices).tolist()]
        return batch


class PartTally:
    """Samples, hits, misses, rejects and waits of one epoch per part (an ``int64
    [parts, 5]`` table, the columns of :class:`~mmcache.stats.PartStats`), from each
    counted batch's rows."""

    #: What a row is (:meth:`add`): served from a tier, produced, left out, taken from
    #: another process that was producing it.
    HIT, MISS, REJECT, WAITED = 0, 1, 2, 3

    def __init__(
        self,
        names: Sequence[str],
        part_of: Callable[[np.ndarray], np.ndarray],
        previous: dict[str, PartStats] | None = None,
    ) -> None:
        self.names = tuple(names)
        self._part_of = part_of
        self.table = np.zeros((len(self.names), 5), dtype=np.int64)
        for k, name in enumerate(self.names):
            p = (previous or {}).get(name)
            if p is not None:
                self.table[k] = (p.samples, p.hits, p.misses, p.rejects, p.waited)

    def add(self, indices: np.ndarray, kinds: np.ndarray) -> None:
        """Count a batch: each row's sample and what it is (:attr:`HIT`, :attr:`MISS`,
        :attr:`REJECT`, :attr:`WAITED`; any other value: not counted)."""
        parts = self._part_of(np.asarray(indices))
        kinds = np.asarray(kinds)
        table = self.table  # columns: samples, hits, misses, rejects, waited
        served = (kinds == self.HIT) | (kinds == self.MISS) | (kinds == self.WAITED)
        for column, flags in (
            (0, served),
            (1, kinds == self.HIT),
            (2, kinds == self.MISS),
            (3, kinds == self.REJECT),
            (4, kinds == self.WAITED),
        ):
            np.add.at(table[:, column], parts[flags], 1)

    def snapshot(self) -> dict[str, PartStats]:
        return {
            name: PartStats(*(int(v) for v in self.table[k])) for k, name in enumerate(self.names)
        }


def new_samples_each_epoch(source: object) -> bool:
    """Whether an epoch of ``source`` reads samples the epoch before did not: a mixture
    with a part whose fraction walks through it (``repeat=0.5``, ``choose`` under its
    size). Its misses are the draw's, not the cache's: the low-hit-rate warning, which
    expects every sample of an epoch to have been offered the epoch before, stays quiet."""
    if not isinstance(source, DrawsEpochs):
        return False
    draw = source.draw
    return any(n and c % n for n, c in zip(draw.sizes, draw.counts, strict=True))


def mixture_state(source: object) -> list[list[Any]] | None:
    """What a loader state records of its source's mixture (None: not a mixture)."""
    if not isinstance(source, DrawsEpochs):
        return None
    describe: list[list[Any]] = source.description()  # type: ignore[attr-defined]
    return [list(row) for row in describe]


def check_mixture_state(state: dict[str, Any], mine: list[list[Any]] | None) -> None:
    """Refuse a state saved with another mixture (or with none, or of a mixture into a
    loader of one source), naming the first part that differs."""
    saved = state.get(STATE_KEY)
    if saved is None and mine is None:
        return
    if mine is None:
        raise ConfigError(
            "cannot resume: the state was saved by a loader over a Mixture, and this "
            "loader reads one source"
        )
    if saved is None:
        raise ConfigError(
            "cannot resume: this loader reads a Mixture, and the state was saved by a "
            "loader over one source"
        )
    if not isinstance(saved, list) or not all(isinstance(r, list) for r in saved):
        raise ConfigError(
            f"cannot resume: state {STATE_KEY} must be a list of lists, got {shown(saved)}"
        )
    if saved == mine:
        return
    if len(saved) != len(mine):
        raise ConfigError(
            f"cannot resume: the state was saved with a mixture of {len(saved) - 1} parts, "
            f"this loader's has {len(mine) - 1}; the epochs' samples would differ"
        )
    fields = ("name", "size", "option", "count")
    for k, (old, new) in enumerate(zip(saved, mine, strict=True)):
        if old != new:
            changes = [
                f"{f} {shown(a)} -> {shown(b)}"
                for f, a, b in zip(fields, old, new, strict=False)
                if a != b
            ]
            where = "the epoch size" if k == len(mine) - 1 else f"part {k}"
            raise ConfigError(
                f"cannot resume: the state was saved with another mixture ({where}: "
                f"{', '.join(changes) or shown(old)}); the epochs' samples would differ"
            )
