"""A mixture's parts and its draw: how many samples each part gives an epoch, and which.

:class:`MixturePart` is one part as the user writes it (a source and at most one of
``repeat``, ``choose``, ``proportion``); :func:`part_counts` turns the parts' options into
exact per-epoch counts (MosaicML Streaming's semantics, the rules are in
:class:`mmcache.Mixture`'s docstring); :class:`MixtureDraw` is the draw itself, which
samples of each part an epoch holds, a pure function of ``(seed, epoch, part)``.

The draw of a part of ``n`` samples and ``c`` per epoch: every sample ``c // n`` times
(the whole repeats), plus ``x = c % n`` *extras* drawn without replacement. The extras
of successive epochs walk through the part: they are consecutive windows of ``x`` over a
stream of passes, each pass a seeded permutation of the part (pass ``p`` seeded by
``(seed, part, p)``), so every sample is drawn once before any is drawn again; with
``repeat=0.5`` over an even ``n``, epochs ``2k`` and ``2k+1`` see every sample exactly
once. An epoch whose window spans the end of one pass and the start of the next takes
from the next pass only samples it does not hold yet (those it skips come right after,
in the next epoch): no sample is drawn twice in one epoch. When ``x`` is more than half
of ``n``, the walk is made of the samples *left out* instead (``n - x`` per epoch), so
the window rule above always has room. Either way, over any ``E`` epochs the samples'
extra counts differ by at most one.

Rejected alternative: Streaming's ``balanced`` sampling draws each epoch's fraction
independently; over a few epochs some samples are never seen while others repeat, which
a user who asked for ``repeat=0.5`` reads as data lost.

Thread/process safety: :class:`MixturePart` and :class:`MixtureDraw` are immutable but
for the draw's memo of recent epochs (plain dict stores and ``clear``: safe in threads,
and no lock a process forked at any moment could inherit held).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache.checks import shown
from mmcache.errors import ConfigError

__all__ = ["MixtureDraw", "MixturePart", "Share", "part_counts"]

_I64 = npt.NDArray[np.int64]
#: Epochs whose draw a :class:`MixtureDraw` remembers (the consumer, the workers' stream
#: and the stat prefetcher may be in two consecutive epochs, and a resumed run in a third).
_MEMO_EPOCHS = 4
#: How far a proportions' sum may be from 1 (decimal fractions in binary floats).
_SUM_TOLERANCE = 1e-9
#: Mixed into the seed of the walk's passes (the sampler's own draws use [seed, epoch]).
_WALK_SALT = 0x6D6978  # "mix"


class MixturePart:
    """One part of a :class:`mmcache.Mixture`: a source and how much of it an epoch holds.

    ``source``: anything a :class:`mmcache.DataLoader` takes (a ``MultimodalDataset``,
    any :class:`~mmcache.sources.base.SampleSource`; an HF dataset through
    ``mmcache.open_source(ds, pipeline=...)``). ``name``: what batches' ``part`` field
    and the per-part statistics call it (default: the source's manifest name, else
    ``part{i}``). At most one of ``repeat`` (samples per epoch: ``repeat`` x its size),
    ``choose`` (that many samples per epoch) and ``proportion`` (that share of the
    mixture's ``epoch_size``); none is ``repeat=1``. Checked, with the part named, when
    the :class:`~mmcache.Mixture` is made.

    >>> MixturePart(object(), name="coco", repeat=3).share
    Share(kind='repeat', value=3)
    """

    __slots__ = ("choose", "name", "proportion", "repeat", "source")

    def __init__(
        self,
        source: Any,
        *,
        name: str | None = None,
        repeat: float | None = None,
        choose: int | None = None,
        proportion: float | None = None,
    ) -> None:
        self.source = source
        self.name = name
        self.repeat = repeat
        self.choose = choose
        self.proportion = proportion

    @property
    def share(self) -> Share:
        """The one option given (``repeat=1`` when none), unchecked."""
        given = [
            (kind, value)
            for kind, value in (
                ("repeat", self.repeat),
                ("choose", self.choose),
                ("proportion", self.proportion),
            )
            if value is not None
        ]
        kind, value = given[0] if given else ("repeat", 1)
        return Share(kind, value)

    def __repr__(self) -> str:
        share = self.share
        return f"MixturePart({type(self.source).__name__}, name={self.name!r}, {share.text})"


@dataclass(frozen=True)
class Share:
    """A part's option: ``kind`` is ``"repeat"``, ``"choose"`` or ``"proportion"``."""

    kind: str
    value: Any

    @property
    def text(self) -> str:
        return f"{self.kind}={self.value!r}"


def check_share(part: MixturePart, name: str) -> Share:
    """The part's option, checked: at most one given, a number of the right kind and
    range. ConfigError naming the part otherwise."""
    given = [
        f"{kind}={shown(value)}"
        for kind, value in (
            ("repeat", part.repeat),
            ("choose", part.choose),
            ("proportion", part.proportion),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ConfigError(
            f"mixture part {name!r}: give at most one of repeat, choose and proportion, "
            f"got {', '.join(given)}"
        )
    share = part.share
    value = share.value
    if share.kind == "choose":
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ConfigError(
                f"mixture part {name!r}: choose must be an int >= 0 (samples per epoch), "
                f"got {shown(value)}"
            )
        return Share("choose", int(value))
    number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, bool
    )
    if not number or not math.isfinite(float(value)) or float(value) < 0:
        raise ConfigError(
            f"mixture part {name!r}: {share.kind} must be a finite number >= 0, got {shown(value)}"
        )
    if share.kind == "proportion" and float(value) > 1:
        raise ConfigError(
            f"mixture part {name!r}: proportion must be in [0, 1] (a share of epoch_size), "
            f"got {shown(value)}"
        )
    return Share(share.kind, value)


def _exact(value: float | int) -> Fraction:
    """``value`` as the decimal the user wrote (``0.1`` is 1/10, not the nearest binary
    float), so that ``repeat=0.3`` of 10 samples is 3, never 2.9999... rounded."""
    if isinstance(value, (int, np.integer)):
        return Fraction(int(value))
    return Fraction(repr(float(value)))


def _round_half_up(value: Fraction) -> int:
    return math.floor(value + Fraction(1, 2))


def _largest_remainder(total: int, weights: Sequence[Fraction]) -> list[int]:
    """``total`` split in proportion to ``weights``: each share its quota rounded down,
    the rest one each to the largest remainders (ties: the earlier part). The shares
    sum to ``total`` exactly and each is its quota's floor or ceiling."""
    whole = sum(weights, Fraction(0))
    quotas = [total * w / whole for w in weights]
    counts = [math.floor(q) for q in quotas]
    left = total - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return counts


def part_counts(
    names: Sequence[str],
    sizes: Sequence[int],
    shares: Sequence[Share],
    epoch_size: int | None,
) -> list[int]:
    """Each part's samples per epoch (see :class:`mmcache.Mixture` for the rules).

    >>> part_counts(["a", "b"], [10, 4], [Share("repeat", 0.5), Share("choose", 6)], None)
    [5, 6]
    >>> part_counts(["a", "b"], [10, 4], [Share("proportion", 0.25),
    ...             Share("proportion", 0.75)], 9)
    [2, 7]
    """
    relative = [i for i, s in enumerate(shares) if s.kind == "proportion"]
    absolute = [i for i, s in enumerate(shares) if s.kind != "proportion"]
    if relative and epoch_size is None:
        raise ConfigError(
            f"mixture part {names[relative[0]]!r} has {shares[relative[0]].text}, a "
            "share of the epoch: pass Mixture(..., epoch_size=N), the samples per epoch"
        )
    if relative and absolute:
        r, a = relative[0], absolute[0]
        raise ConfigError(
            f"mixture part {names[a]!r} has {shares[a].text} but part {names[r]!r} has "
            f"{shares[r].text}: proportions (shares of epoch_size) and repeat/choose "
            "(absolute counts) do not mix; give every part a proportion, or none"
        )
    for i, (size, share) in enumerate(zip(sizes, shares, strict=True)):
        if size == 0 and share.kind != "repeat" and share.value:
            raise ConfigError(
                f"mixture part {names[i]!r} has no samples, so it cannot give "
                f"{share.text}; leave it out of the mixture"
            )
    if relative and epoch_size is not None:
        fractions = [_exact(s.value) for s in shares]
        total = sum(fractions, Fraction(0))
        if abs(float(total) - 1.0) > _SUM_TOLERANCE:
            listed = ", ".join(f"{n}={float(f):g}" for n, f in zip(names, fractions, strict=True))
            raise ConfigError(f"mixture proportions must sum to 1, got {float(total):g} ({listed})")
        return _largest_remainder(epoch_size, fractions)
    counts = []
    for size, share in zip(sizes, shares, strict=True):
        if share.kind == "choose":
            counts.append(int(share.value))
        else:
            counts.append(_round_half_up(_exact(share.value) * size))
    if epoch_size is None:
        return counts
    if not sum(counts):
        if epoch_size:
            raise ConfigError(
                f"mixture epoch_size={epoch_size} but every part gives 0 samples per epoch"
            )
        return counts
    return _largest_remainder(epoch_size, [Fraction(c) for c in counts])


def _salt(name: str) -> int:
    """A part's seed word from its name: its draw does not change when parts are
    added, removed or reordered around it."""
    return int(xxhash.xxh64_intdigest(name.encode("utf-8")))


@dataclass(frozen=True)
class MixtureDraw:
    """Which samples of each part an epoch holds (see the module docstring).

    ``sizes`` and ``counts`` per part, in the mixture's order; indices are positions in
    the parts' concatenation (part ``k`` starts at ``offsets[k]``). What the epoch
    sampler asks for (:meth:`indices`) before it shuffles: the parts in order, each
    part's whole repeats, then its extras.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    counts: tuple[int, ...]
    _memo: dict[tuple[int, int], _I64] = field(
        default_factory=dict, compare=False, repr=False, hash=False
    )

    @property
    def offsets(self) -> _I64:
        """Where each part starts in the concatenation (``int64 [parts + 1]``)."""
        return np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]).astype(np.int64)

    @property
    def size(self) -> int:
        """Samples per epoch: the counts' sum."""
        return int(sum(self.counts))

    def reads_per_epoch(self) -> npt.NDArray[np.float64]:
        """Each part's mean reads of one sample per epoch (``count / size``; 0 for an
        empty part): what an entry of that part saves per epoch it stays cached."""
        return np.array(
            [c / n if n else 0.0 for c, n in zip(self.counts, self.sizes, strict=True)],
            dtype=np.float64,
        )

    def indices(self, seed: int, epoch: int) -> _I64:
        """The samples of ``epoch`` (``int64 [size]``, read-only): each part's whole
        repeats then its extras, parts in order. A pure function of ``(seed, epoch)``
        and the parts; remembered for the last few epochs."""
        memo_key = (int(seed), int(epoch))
        drawn = self._memo.get(memo_key)
        if drawn is None:
            offsets = self.offsets
            pieces = [
                offsets[k] + self.part_indices(seed, epoch, k) for k in range(len(self.sizes))
            ]
            drawn = np.concatenate([np.zeros(0, np.int64), *pieces]).astype(np.int64)
            drawn.flags.writeable = False
            if len(self._memo) >= _MEMO_EPOCHS:
                self._memo.clear()  # (one atomic call: no lock, see the module docstring)
            self._memo[memo_key] = drawn
        return drawn

    def part_indices(self, seed: int, epoch: int, k: int) -> _I64:
        """Part ``k``'s samples of ``epoch``, as positions in the part."""
        n, c = self.sizes[k], self.counts[k]
        if n == 0 or c == 0:
            return np.zeros(0, dtype=np.int64)
        whole, extra = divmod(c, n)
        base = np.tile(np.arange(n, dtype=np.int64), whole)
        if extra == 0:
            return base
        walk = _Walk(n, seed, _salt(self.names[k]))
        if 2 * extra <= n:
            extras = walk.window(epoch, extra)
        else:  # the samples left out walk instead: n - extra < n / 2 of them
            keep = np.ones(n, dtype=bool)
            keep[walk.window(epoch, n - extra)] = False
            extras = np.flatnonzero(keep).astype(np.int64)
        return np.concatenate([base, extras])


@dataclass(frozen=True)
class _Walk:
    """Windows over the stream of passes of one part (``2 * width <= n`` always: then
    the head a pass reorders, at most ``width`` long, ends before the tail its own
    next boundary takes, so pass ``p`` depends on passes ``p - 1`` and ``p`` only)."""

    n: int
    seed: int
    salt: int

    def _raw(self, p: int) -> _I64:
        rng = np.random.Generator(
            np.random.PCG64(np.random.SeedSequence([self.seed, _WALK_SALT, self.salt, p]))
        )
        return rng.permutation(self.n).astype(np.int64)

    def _tail(self, p: int, width: int) -> _I64:
        """The samples of pass ``p`` that the epoch spanning its end takes (empty when
        an epoch ends exactly there)."""
        end = (p + 1) * self.n
        start = (end // width) * width  # the first position of that epoch
        return self._raw(p)[start - p * self.n :] if start < end else self._raw(p)[:0]

    def _pass(self, p: int, width: int) -> _I64:
        """Pass ``p`` as the stream holds it: its raw permutation, with the first samples
        not in the previous pass's spanning tail moved to the front, so the epoch that
        spans the boundary holds no sample twice (the ones skipped follow them)."""
        raw = self._raw(p)
        if p == 0:
            return raw
        tail = self._tail(p - 1, width)
        if not len(tail):
            return raw
        head = width - len(tail)
        fresh = ~np.isin(raw, tail)
        take = np.flatnonzero(fresh)[:head]
        stop = int(take[-1]) + 1 if len(take) else 0
        skipped = np.flatnonzero(~fresh[:stop])
        return np.concatenate([raw[take], raw[skipped], raw[stop:]])

    def window(self, epoch: int, width: int) -> _I64:
        """Positions ``[epoch * width, (epoch + 1) * width)`` of the stream."""
        a = epoch * width
        b = a + width
        p, q = a // self.n, (b - 1) // self.n
        first = self._pass(p, width)
        if p == q:
            return first[a - p * self.n : b - p * self.n]
        rest = self._pass(q, width)
        return np.concatenate([first[a - p * self.n :], rest[: b - q * self.n]])
