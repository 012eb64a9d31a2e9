"""What a source may offer beyond :class:`~mmcache.sources.base.SampleSource`, declared.

The core asks a source for more than the protocol in four places: length grouping and
packing need each sample's token count, batching needs the fields' layout, the remote
prefetcher needs revalidation and fetching, and reports need what was skipped. Each is a
named, runtime-checkable protocol here, and the core asks ``isinstance(source, HasLengths)``
instead of probing ``getattr(source, "lengths", None)``:

- the contract of each is written once (:mod:`mmcache.testing.source_contract` has a
  check per capability: a source that claims :class:`HasLengths` must give lengths of the
  right shape);
- a source that lacks one the user asked for gets a :class:`~mmcache.errors.ConfigError`
  naming the capability and its members (:func:`require`), not an ``AttributeError`` from
  deep inside the loader;
- a source with only part of a capability (``varying_fields`` but no
  ``channels_last_fields``) is refused by :func:`layout_of` instead of being half read.

``isinstance`` on these protocols only checks that the members exist (typing's
runtime check); their types are mypy's, their shapes the contract suite's.

Thread/process safety: pure declarations and functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from mmcache.errors import ConfigError

if TYPE_CHECKING:
    from mmcache.sources.rejects import Reject

# The remote types below are ``Any``: mmcache.sources.blobs uses these protocols, and the
# package's modules may not import each other both ways (not even for types).

__all__ = [
    "CAPABILITIES",
    "DrawsEpochs",
    "FieldLayout",
    "ForeseesReads",
    "GroupedFetching",
    "HasLengths",
    "HasRejects",
    "Layout",
    "Revalidating",
    "SharesStamps",
    "index_count",
    "layout_of",
    "members_of",
    "require",
]


@runtime_checkable
class HasLengths(Protocol):
    """Each sample's token count and modality without producing it (for
    ``group_by_length`` and ``pack=``; see :mod:`mmcache.loader.lengths`)."""

    def lengths(self) -> np.ndarray:
        """``int64 [N]``: tokens of each sample's ``input_ids`` (0: a sample it refuses)."""
        ...

    def modalities(self) -> np.ndarray:
        """``bool [N]``: whether each sample keeps an image (grouped apart from text-only)."""
        ...


@runtime_checkable
class FieldLayout(Protocol):
    """How the fields of a source's samples are laid out (what batching reads)."""

    @property
    def varying_fields(self) -> frozenset[str]:
        """Fields whose shapes vary between samples (empty: fixed shapes, stacked)."""
        ...

    @property
    def channels_last_fields(self) -> frozenset[str]:
        """Fields cached as ``[H, W, C]``, presented as ``[C, H, W]`` views."""
        ...

    @property
    def pad_token_id(self) -> int | None:
        """What SFT batches pad ``input_ids`` with (None: no chat stage)."""
        ...


@runtime_checkable
class Revalidating(Protocol):
    """A source of remote bytes: checked again each epoch and fetched ahead of use
    (what :class:`~mmcache.sources.blobs.prefetch.RemotePrefetch` drives)."""

    #: The :class:`~mmcache.sources.blobs.raw.RawTier` fetched into (None: none).
    raw: Any
    #: The :class:`~mmcache.sources.blobs.objects.Remote` the bytes come through.
    remote: Any
    #: Whether samples' bytes are fetched ahead into :attr:`raw` (:meth:`remote_span`);
    #: ``False``: another reader reads them (Parquet rows, through pyarrow), and the
    #: prefetcher only revalidates the source.
    fetches_ahead: bool

    def revalidate(self) -> list[str]:
        """Check every object's version again; re-key the changed ones; return them."""
        ...

    def remote_version(self) -> tuple[str, ...]:
        """The objects' stamps: what a memory of fetched spans depends on."""
        ...

    def remote_span(self, index: int) -> tuple[str, str, int, int] | None:
        """``(url, stamp, start, end)`` of sample ``index``'s bytes (None: nothing remote)."""
        ...

    def fetch(
        self, url: str, stamp: str, start: int, end: int, *, sample_id: str, wait: bool = True
    ) -> bytes:
        """Bytes ``[start, end)`` of version ``stamp`` of ``url`` (raw tier, else a GET)."""
        ...


@runtime_checkable
class GroupedFetching(Protocol):
    """A remote source whose neighbouring samples are fetched with one ranged GET."""

    def fetch_groups(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The fetch group of each of ``indices`` (``int64``; ``-1``: nothing remote)."""
        ...

    def fetch_group(self, group: int) -> tuple[str, str, list[tuple[int, int, int]]]:
        """``(url, stamp, [(index, start, end), ...])`` of one group's samples."""
        ...


@runtime_checkable
class ForeseesReads(Protocol):
    """A source whose samples share reads (a Parquet row group is read whole for any of
    its rows) and that, told the samples this process produces next, keeps what each read
    brings for the ones to come instead of reading it again (the loader's workers tell it:
    :mod:`mmcache.loader.lookahead`). A hint only: what it produces is the same."""

    def foresee(self, indices: np.ndarray) -> None:
        """The samples this process produces next, in order, from position 0 (replaces
        what was foreseen; empty: nothing is)."""
        ...

    def reached(self, position: int) -> None:
        """Production has got to ``position`` of what was foreseen (the samples before it
        are done or were produced elsewhere)."""
        ...


@runtime_checkable
class SharesStamps(Protocol):
    """A source whose revalidated stamps reach its other processes through a file
    (the gate that holds key lookups back while a revalidation runs)."""

    @property
    def shared_stamps(self) -> Any:
        """The :class:`~mmcache.sources.blobs.state.SharedStamps` file and gate."""
        ...


@runtime_checkable
class HasRejects(Protocol):
    """A source that lists what it left out (at open, and skipped since, any process)."""

    def rejects(self) -> list[Reject]: ...


@runtime_checkable
class DrawsEpochs(Protocol):
    """A source whose epochs are drawn from its samples: a :class:`mmcache.Mixture`.

    ``len()`` is the samples of one epoch, while its indices range over
    :attr:`unique_samples` (the parts' samples, concatenated): the epoch sampler shuffles
    ``draw.indices(seed, epoch)`` (repeats included) instead of ``range(len)``. The
    loader names each row's part (:meth:`part_of`, :attr:`part_names`), counts per part,
    and weighs an admitted entry's miss cost by :meth:`planned_reads`.
    """

    @property
    def unique_samples(self) -> int:
        """How many distinct samples (the range of the indices)."""
        ...

    @property
    def draw(self) -> Any:
        """What the sampler asks (``indices(seed, epoch)``, ``size``; see
        :class:`mmcache.sampler.EpochDraw`)."""
        ...

    @property
    def part_names(self) -> tuple[str, ...]:
        """The parts' names, in order."""
        ...

    def part_of(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The part number of each of ``indices`` (``int64``)."""
        ...

    def planned_reads(self, index: int) -> float:
        """How often sample ``index`` is read per epoch on average (its part's count
        over its size): what keeping it cached saves, per unit of its miss cost."""
        ...


#: Every capability, by name (the contract suite and the messages name them so).
CAPABILITIES: tuple[type, ...] = (
    HasLengths,
    FieldLayout,
    Revalidating,
    GroupedFetching,
    SharesStamps,
    HasRejects,
    DrawsEpochs,
    ForeseesReads,
)


def index_count(source: object) -> int:
    """How many distinct sample indices ``source`` has: ``len(source)``, or its
    :attr:`DrawsEpochs.unique_samples` (a mixture's ``len`` is one epoch's samples).
    What per-sample arrays (learnt keys, lengths, homes) are sized by."""
    if isinstance(source, DrawsEpochs):
        return int(source.unique_samples)
    return len(source)  # type: ignore[arg-type]


def members_of(capability: type) -> list[str]:
    """The member names ``capability`` declares (what ``isinstance`` looks for)."""
    names: Any = getattr(capability, "__protocol_attrs__", None)
    if names is None:  # Python < 3.12 keeps them under another name
        from typing import _get_protocol_attrs  # type: ignore[attr-defined]

        names = _get_protocol_attrs(capability)
    return sorted(names)


def require(source: object, capability: type, *, why: str) -> None:
    """ConfigError unless ``source`` offers ``capability``, saying ``why`` it is needed,
    which members the capability is and which of them the source lacks."""
    if isinstance(source, capability):
        return
    members = members_of(capability)
    missing = [m for m in members if not hasattr(source, m)]
    raise ConfigError(
        f"{why} needs a source with {capability.__name__} ({', '.join(members)}), but "
        f"{type(source).__name__} has no {', '.join(missing)}"
    )


class Layout:
    """A source's :class:`FieldLayout`, read once (the defaults when it has none)."""

    __slots__ = ("channels_last", "pad_token_id", "varying")

    def __init__(
        self, varying: frozenset[str], channels_last: frozenset[str], pad_token_id: int | None
    ) -> None:
        self.varying = varying
        self.channels_last = channels_last
        self.pad_token_id = pad_token_id


def layout_of(source: object) -> Layout:
    """The field layout of ``source``: its :class:`FieldLayout`, or fixed shapes,
    channels first and no pad id when it declares none of the three members; a source
    with only some of them is a ConfigError naming the missing ones (half a layout
    would batch its samples wrong)."""
    if isinstance(source, FieldLayout):
        pad = source.pad_token_id
        return Layout(
            frozenset(str(n) for n in source.varying_fields or ()),
            frozenset(str(n) for n in source.channels_last_fields or ()),
            None if pad is None else int(pad),
        )
    if any(hasattr(source, m) for m in members_of(FieldLayout)):
        require(source, FieldLayout, why="batching its samples")
    return Layout(frozenset(), frozenset(), None)
