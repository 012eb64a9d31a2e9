"""``Mixture``: many sources blended into one epoch, as VLM training recipes define them.

A mixture is a source (:class:`~mmcache.sources.base.SampleSource`) over its parts'
samples, concatenated: index ``i`` is sample ``i - offsets[k]`` of part ``k``. Keys,
stamps, ids, production and items are the parts' own (a sample cached through its part
alone is the same entry under the mixture); what the mixture adds is the epoch: which of
its samples an epoch holds and how often (:class:`~mmcache.sources.mixparts.MixtureDraw`),
which the loader's sampler shuffles instead of ``range(len)`` (the
:class:`~mmcache.sources.capabilities.DrawsEpochs` capability), and each row's part.

The recipes' own mixture files are read by :mod:`mmcache.sources.mixture_files`
(:meth:`Mixture.from_internvl`, :meth:`Mixture.from_llava_onevision`).

Thread/process safety: read-only after construction but for the reject log
(process-safe) and the parts' own per-process memos; pickles as its parts do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from mmcache.errors import ConfigError, SampleError
from mmcache.keys import STAT_FIELDS
from mmcache.sources import mixture_files
from mmcache.sources.base import OnError, SampleSource, StampKind
from mmcache.sources.capabilities import HasLengths, HasRejects, Layout, layout_of
from mmcache.sources.files import FileSource
from mmcache.sources.mixparts import MixtureDraw, MixturePart, check_share, part_counts
from mmcache.sources.rejects import Reject, RejectLog

__all__ = ["Mixture", "MixturePart"]

logger = logging.getLogger(__name__)

_I64 = npt.NDArray[np.int64]


class Mixture:
    """Parts (sources) blended into one epoch: ``DataLoader(mix, cache=..., shuffle=True,
    seed=...)`` works as for one dataset, and ``len(mix)`` is the samples of one epoch.

    Args:
        parts: :class:`MixturePart` objects (or bare sources: ``repeat=1``), in order.
        epoch_size: the samples of one epoch when parts give a ``proportion``; with
            none, it rescales the parts' absolute counts to this total.

    The semantics are MosaicML Streaming's (``Stream(repeat=, choose=, proportion=)``):

    | option | samples of the part in each epoch |
    |---|---|
    | none | every sample once (``repeat=1``) |
    | ``repeat=r`` | ``round(r * len(part))``: each sample ``floor(r)`` times, plus a \
seeded subset for the fraction |
    | ``choose=k`` | ``k`` (``repeat=k / len(part)``) |
    | ``proportion=p`` | ``p * epoch_size`` by largest remainders: the proportions sum \
to 1 and the counts to ``epoch_size`` |
    | ``epoch_size=N`` | (no proportions) each part's count above, rescaled by largest \
remainders to sum to ``N`` |

    - At most one of ``repeat`` / ``choose`` / ``proportion`` per part; proportions
      (relative) and repeat/choose (absolute) do not mix in one mixture; a
      ``proportion`` without ``epoch_size`` is a ConfigError, as are negative values,
      a proportion over 1 and parts whose pipelines give other batch fields (other
      varying or channels-last fields, another pad id) or another ``on_error``; each
      error names the part. ``round`` is half up, on the decimal the option was written
      as (``repeat=0.3`` of 10 samples is 3).
    - A fractional share draws without replacement inside an epoch and walks through
      the part across epochs: every sample is drawn once before any is drawn again
      (with ``repeat=0.5`` of an even-sized part, epochs ``2k`` and ``2k+1`` together
      see each sample exactly once). The draw depends only on ``(seed, epoch, part
      name)``: adding a part leaves the others' draws as they were. The loader's seed
      is the seed, and the epoch's order is the drawn samples shuffled.
    - ``len(mix)`` is the sum of the parts' counts; :attr:`unique_samples` the parts'
      sizes' sum (the range of the indices).
    - Every batch carries ``part`` (a list of str: each row's part name), and
      ``loader.stats()`` counts samples, hits and misses per part.
    - A resumed loader refuses a state saved with another mixture (parts, sizes or
      options changed), naming what changed.
    - The cache knows the future: an admitted entry's miss cost is weighed by its
      part's reads per epoch (``count / len(part)``), so with memory for a fraction of
      the samples, the ``value`` policy keeps those that come back most often.

    >>> import mmcache as mc                                            # doctest: +SKIP
    >>> mix = mc.Mixture([mc.MixturePart(coco, repeat=3),
    ...                   mc.MixturePart(chat, choose=1000, name="chat")])  # doctest: +SKIP
    >>> loader = mc.DataLoader(mix, cache=cache, batch_size=32)        # doctest: +SKIP
    """

    def __init__(
        self,
        parts: Sequence[MixturePart | SampleSource],
        *,
        epoch_size: int | None = None,
    ) -> None:
        if isinstance(parts, (str, bytes, Mapping)) or not isinstance(parts, Sequence):
            raise ConfigError(
                f"Mixture takes a list of MixturePart (or sources), got {type(parts).__name__}"
            )
        if not parts:
            raise ConfigError("a Mixture needs at least one part")
        if epoch_size is not None and (
            isinstance(epoch_size, bool) or not isinstance(epoch_size, int) or epoch_size < 0
        ):
            raise ConfigError(f"Mixture epoch_size must be an int >= 0 or None, got {epoch_size!r}")
        given = [p if isinstance(p, MixturePart) else MixturePart(p) for p in parts]
        names = _names(given)
        for part, name in zip(given, names, strict=True):
            if not isinstance(part.source, SampleSource):
                raise ConfigError(
                    f"mixture part {name!r}: its source must be a mmcache source (a "
                    "MultimodalDataset, or mmcache.open_source(...) of a file, folder or HF "
                    f"dataset), got {type(part.source).__name__}"
                )
        shares = [check_share(p, n) for p, n in zip(given, names, strict=True)]
        self._sources: tuple[SampleSource, ...] = tuple(p.source for p in given)
        sizes = [len(s) for s in self._sources]
        counts = part_counts(names, sizes, shares, epoch_size)
        self.epoch_size = epoch_size
        self._shares = tuple(shares)
        self._draw = MixtureDraw(tuple(names), tuple(sizes), tuple(counts))
        self._offsets = self._draw.offsets
        self._reads = self._draw.reads_per_epoch()
        self._layout = _common_layout(self._sources, names)
        self.on_error: OnError = _common_on_error(self._sources, names)
        self.stamp_kind: StampKind = _stamp_kind(self._sources)
        self._stamp_width = self._widths()
        self._rejects = RejectLog()
        self._ids_digest: str | None = None

    # -- the mixture ----------------------------------------------------------------------
    # -- the recipes' files ----------------------------------------------------------------
    @classmethod
    def from_internvl(
        cls,
        meta_json: str | os.PathLike[str],
        *,
        pipeline: Any,
        base_dir: str | os.PathLike[str] | None = None,
        on_error: OnError = "raise",
        subset_seed: int = 0,
        epoch_size: int | None = None,
    ) -> Mixture:
        """The mixture of an InternVL meta file (``--meta_path``): one part per entry,
        named by its key, ``repeat_time`` as its repeat (below 1: a fixed seeded subset,
        as InternVL keeps), images relative to its ``root``; see
        :mod:`mmcache.sources.mixture_files`. ``base_dir``: what relative paths in the
        file resolve against (default: the working directory, as InternVL's scripts)."""
        parts = mixture_files.internvl_parts(
            meta_json,
            pipeline=pipeline,
            base_dir=base_dir,
            on_error=on_error,
            subset_seed=subset_seed,
        )
        return cls(parts, epoch_size=epoch_size)

    @classmethod
    def from_llava_onevision(
        cls,
        yaml_path: str | os.PathLike[str],
        *,
        image_folder: str | os.PathLike[str],
        video_folder: str | os.PathLike[str] | None = None,
        pipeline: Any,
        base_dir: str | os.PathLike[str] | None = None,
        on_error: OnError = "raise",
        subset_seed: int = 0,
        epoch_size: int | None = None,
    ) -> Mixture:
        """The mixture of a LLaVA-OneVision data YAML (LLaVA-NeXT's ``--data_path``): one
        part per ``datasets`` entry, named by its file, kept as its ``sampling_strategy``
        says (``all``, ``first:N``, ``end:N``, ``random:N``; N a count or ``P%``), images
        relative to ``image_folder`` and videos to ``video_folder``; see
        :mod:`mmcache.sources.mixture_files`."""
        parts = mixture_files.onevision_parts(
            yaml_path,
            image_folder=image_folder,
            video_folder=video_folder,
            pipeline=pipeline,
            base_dir=base_dir,
            on_error=on_error,
            subset_seed=subset_seed,
        )
        return cls(parts, epoch_size=epoch_size)

    @property
    def parts(self) -> tuple[MixturePart, ...]:
        """The parts, their names resolved and their options as given."""
        return tuple(
            MixturePart(s, name=n, **{sh.kind: sh.value})
            for s, n, sh in zip(self._sources, self._draw.names, self._shares, strict=True)
        )

    @property
    def part_names(self) -> tuple[str, ...]:
        return self._draw.names

    @property
    def counts(self) -> dict[str, int]:
        """Each part's samples per epoch, by name."""
        return dict(zip(self._draw.names, self._draw.counts, strict=True))

    @property
    def unique_samples(self) -> int:
        """The parts' samples, each counted once: indices range over ``[0, this)``."""
        return int(self._offsets[-1])

    @property
    def draw(self) -> MixtureDraw:
        """Which samples each epoch holds (what the loader's sampler shuffles)."""
        return self._draw

    def __len__(self) -> int:
        return self._draw.size

    def part_of(self, indices: Sequence[int] | np.ndarray) -> _I64:
        """The part number of each of ``indices``."""
        idx = self._checked(indices)
        return (np.searchsorted(self._offsets, idx, side="right") - 1).astype(np.int64)

    def planned_reads(self, index: int) -> float:
        return float(self._reads[int(self.part_of([index])[0])])

    def description(self) -> list[list[Any]]:
        """``[name, size, option, count]`` per part, and the epoch size: what a loader
        state records, so that a resume with another mixture names what changed."""
        rows: list[list[Any]] = [
            [n, size, sh.text, c]
            for n, size, sh, c in zip(
                self._draw.names, self._draw.sizes, self._shares, self._draw.counts, strict=True
            )
        ]
        return [*rows, ["epoch_size", self.epoch_size]]

    def __repr__(self) -> str:
        inner = ", ".join(
            f"{n}: {sh.text} ({c} of {size})"
            for n, size, sh, c in zip(
                self._draw.names, self._draw.sizes, self._shares, self._draw.counts, strict=True
            )
        )
        return f"Mixture({inner}; {len(self)} per epoch)"

    # -- which sample -------------------------------------------------------------------
    def _checked(self, indices: Sequence[int] | np.ndarray) -> _I64:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = self.unique_samples
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"sample index out of range for the mixture's {n} samples")
        return idx

    def _split(self, indices: Sequence[int] | np.ndarray) -> Iterator[tuple[int, _I64, _I64]]:
        """``(part, rows, local indices)`` of each part ``indices`` touch."""
        idx = self._checked(indices)
        parts = np.searchsorted(self._offsets, idx, side="right") - 1
        for k in np.unique(parts).tolist():
            rows = np.flatnonzero(parts == k)
            yield k, rows, idx[rows] - self._offsets[k]

    def _one(self, index: int) -> tuple[int, int]:
        k = int(self.part_of([index])[0])
        return k, int(index) - int(self._offsets[k])

    def sample_id(self, index: int) -> str:
        k, local = self._one(index)
        return self._sources[k].sample_id(local)

    def ids(self, indices: Sequence[int] | np.ndarray) -> list[str]:
        out: list[str] = [""] * len(np.asarray(indices).reshape(-1))
        for k, rows, local in self._split(indices):
            for r, sid in zip(rows.tolist(), self._sources[k].ids(local), strict=True):
                out[r] = sid
        return out

    def ids_digest(self) -> str:
        """A digest of the parts' names, sizes, options and ids digests in order."""
        if self._ids_digest is None:
            parts = [
                [row, s.ids_digest()]
                for row, s in zip(self.description(), self._sources, strict=False)
            ]
            text = json.dumps([parts, self.epoch_size], sort_keys=True)
            self._ids_digest = "mix:" + xxhash.xxh3_128_hexdigest(text.encode("utf-8"))
        return self._ids_digest

    # -- the parts' processing ----------------------------------------------------------
    def fingerprint(self) -> str:
        """The parts' pipeline fingerprint when they share one; else a digest of theirs
        (each key holds its own part's)."""
        fps = sorted({s.fingerprint() for s in self._sources})
        if len(fps) == 1:
            return fps[0]
        return xxhash.xxh3_128_hexdigest("\x00".join(fps).encode("utf-8"))

    def describe(self) -> str:
        described = dict.fromkeys(s.describe() for s in self._sources)
        return " | ".join(described)

    @property
    def varying_fields(self) -> frozenset[str]:
        return self._layout.varying

    @property
    def channels_last_fields(self) -> frozenset[str]:
        return self._layout.channels_last

    @property
    def pad_token_id(self) -> int | None:
        return self._layout.pad_token_id

    # -- stamps and keys ----------------------------------------------------------------
    def _widths(self) -> int:
        """The words of a stamp row: a file's stat under ``FILE`` (the loader's file
        check reads that many), else the widest part's."""
        if self.stamp_kind is StampKind.FILE:
            return len(STAT_FIELDS)
        widths = [s.stamps(np.zeros(1, np.int64)).shape[1] for s in self._sources if len(s)]
        return max(widths, default=1)

    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Each part's stamps, in a row of :attr:`_stamp_width` words (zero-padded).
        In a mixture of file and fixed parts (``FILE``), a fixed part's rows are zeros:
        nothing to re-check (its keys were fixed when it was opened)."""
        idx = self._checked(indices)
        out = np.zeros((len(idx), self._stamp_width), dtype=np.int64)
        for k, rows, local in self._split(idx):
            source = self._sources[k]
            if self.stamp_kind is StampKind.FILE and source.stamp_kind is not StampKind.FILE:
                continue
            got = np.asarray(source.stamps(local), dtype=np.int64)
            out[rows, : got.shape[1]] = got
        return out

    def key_rows(
        self, indices: Sequence[int] | np.ndarray, *, stamps: np.ndarray | None = None
    ) -> np.ndarray:
        """Each sample's key from its own part (``stamps``: :meth:`stamps` rows, passed
        on to the file parts). Not thread-safe (one thread per process calls it)."""
        idx = self._checked(indices)
        out = np.empty((len(idx), 16), dtype=np.uint8)
        for k, rows, local in self._split(idx):
            source = self._sources[k]
            own = None
            if stamps is not None and source.stamp_kind is StampKind.FILE:
                own = np.ascontiguousarray(stamps[rows, : len(STAT_FIELDS)])
            out[rows] = source.key_rows(local, stamps=own)
        return out

    def key(self, index: int) -> bytes:
        return bytes(self.key_rows([index])[0].tobytes())

    # -- serving ------------------------------------------------------------------------
    def produce(self, index: int) -> dict[str, np.ndarray]:
        k, local = self._one(index)
        return self._sources[k].produce(local)

    def to_item(self, index: int, sample: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """The part's item, with ``part``: its name."""
        k, local = self._one(index)
        item = self._sources[k].to_item(local, sample)
        item["part"] = self._draw.names[k]
        return item

    def record_reject(self, err: Exception) -> None:
        """Append a reject to the mixture's process-shared log."""
        if not isinstance(err, SampleError):
            err = SampleError(f"{type(err).__name__}: {err}", sample_id="<unknown>")
        self._rejects.record(err)
        logger.warning("skipped %s", err)

    def rejects(self) -> list[Reject]:
        """What the parts left out (at open, and skipped when used alone), then what
        the loader skipped of the mixture."""
        out: list[Reject] = []
        for source in self._sources:
            if isinstance(source, HasRejects):
                out.extend(source.rejects())
        seen: dict[str, Reject] = {}
        for rej in self._rejects.read():
            seen.setdefault(rej.sample_id, rej)
        return [*out, *seen.values()]

    # -- lengths (group_by_length, pack=) -------------------------------------------------
    def lengths(self) -> np.ndarray:
        """The parts' token counts, concatenated; a part without them is a ConfigError
        naming it (grouping and packing need every part's)."""
        pieces = []
        for name, source in zip(self._draw.names, self._sources, strict=True):
            if not isinstance(source, HasLengths):
                raise ConfigError(
                    f"mixture part {name!r} ({type(source).__name__}) has no lengths(): "
                    "group_by_length and pack= need token counts from every part (a chat "
                    "pipeline's source)"
                )
            with _naming(name):
                pieces.append(np.asarray(source.lengths(), dtype=np.int64).reshape(-1))
        return np.concatenate([np.zeros(0, np.int64), *pieces])

    def modalities(self) -> np.ndarray:
        """Whether each sample has an image (all False for a part without lengths)."""
        pieces = []
        for name, source in zip(self._draw.names, self._sources, strict=True):
            if isinstance(source, HasLengths):
                with _naming(name):
                    pieces.append(np.asarray(source.modalities(), dtype=bool).reshape(-1))
            else:
                pieces.append(np.zeros(len(source), dtype=bool))
        return np.concatenate([np.zeros(0, bool), *pieces])


@contextlib.contextmanager
def _naming(name: str) -> Iterator[None]:
    """A part's ConfigError, with the part named (the context added at the boundary)."""
    try:
        yield
    except ConfigError as err:
        raise ConfigError(f"mixture part {name!r}: {err}") from err


def _names(parts: list[MixturePart]) -> list[str]:
    """Each part's name: given, or its manifest's name, or ``part{i}``; every one a
    non-empty string, no two alike (ConfigError naming both)."""
    names = []
    for i, part in enumerate(parts):
        name = part.name
        if name is None:
            source = part.source
            if isinstance(source, FileSource):
                name = Path(source.records.source).stem or f"part{i}"
            else:
                name = f"part{i}"
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"mixture part {i}: name must be a non-empty str, got {name!r}")
        names.append(name)
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if name in first:
            raise ConfigError(
                f"mixture parts {first[name]} and {i} are both named {name!r}: give each "
                "MixturePart its own name= (batches' 'part' and the per-part stats use it)"
            )
        first[name] = i
    return names


def _common_layout(sources: Sequence[SampleSource], names: Sequence[str]) -> Layout:
    """The parts' field layout, which must be one: a batch holds rows of every part."""
    layouts = [layout_of(s) for s in sources]
    ref = layouts[0]
    for name, lay in zip(names[1:], layouts[1:], strict=True):
        for what, mine, theirs in (
            ("varying fields", lay.varying, ref.varying),
            ("channels-last fields", lay.channels_last, ref.channels_last),
            ("pad token id", lay.pad_token_id, ref.pad_token_id),
        ):
            if mine != theirs:
                show = sorted(mine) if isinstance(mine, frozenset) else mine
                first = sorted(theirs) if isinstance(theirs, frozenset) else theirs
                raise ConfigError(
                    f"mixture part {name!r} gives other batch fields than part {names[0]!r}: "
                    f"{what} {show} against {first}; one batch holds rows of every part, so "
                    "their pipelines must give the same fields (use one pipeline)"
                )
    return ref


def _common_on_error(sources: Sequence[SampleSource], names: Sequence[str]) -> OnError:
    first = sources[0].on_error
    for name, source in zip(names, sources, strict=True):
        if source.on_error != first:
            raise ConfigError(
                f"mixture part {name!r} has on_error={source.on_error!r} but part "
                f"{names[0]!r} has {first!r}: open every part with the same on_error"
            )
    return first


def _stamp_kind(sources: Sequence[SampleSource]) -> StampKind:
    """``CONTENT`` if a part is keyed afresh each batch (no guess may skip it), else
    ``FILE`` if a part's files are re-checked each epoch, else ``FIXED``."""
    kinds = {s.stamp_kind for s in sources}
    for kind in (StampKind.CONTENT, StampKind.FILE):
        if kind in kinds:
            return kind
    return StampKind.FIXED
