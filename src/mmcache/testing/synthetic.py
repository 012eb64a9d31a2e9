"""A source of ids and stamps without bytes: the control plane driven at any N.

:class:`SyntheticSource` is a :class:`~mmcache.sources.chassis.BaseSource` whose samples
exist only as ids (one UTF-8 buffer plus offsets, as every real source holds them, or
positions) and stamps computed from the index (a ``StampKind.FILE`` source's four stat
fields, or a ``FIXED`` one's), and whose ``produce`` returns the sample's index as one
``int64``. Everything the loader, the sampler, the keys, ``state_dict`` and the claims do
with a source is then what a real source of that many samples costs them, without a
file, a manifest or a decode: what ``benchmarks/control_plane.py`` drives at 10^8 samples
and ``tests/unit/test_control_plane.py`` at 10^5. It passes the source contract
(``tests/unit/test_synthetic_source.py``).

What it holds: the ids (``ids="strings"``: 19 bytes a sample, 11 of text and an offset;
``"positions"``: nothing) and the samples changed since it was opened (:meth:`touch`, a
test's or a simulation's "the file was rewritten": two small arrays, nothing per sample).
The ids are built in chunks, so opening 10^8 samples never holds more than the column.

Thread/process safety: as :class:`~mmcache.sources.chassis.BaseSource`; :meth:`touch`
changes this object only (call it before the source is handed to workers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from mmcache import keys
from mmcache.errors import ConfigError, ManifestError, SampleError
from mmcache.sources.base import OnError, StampKind
from mmcache.sources.chassis import BaseSource
from mmcache.sources.ids import IdColumn, duplicate_message
from mmcache.transforms.stage import Stage

__all__ = ["SyntheticPipeline", "SyntheticSource"]

#: Digits of a string id (``"s0000000042"``): room for 10^10 samples, one width at every N,
#: so that sample i has the same id (and key) in a source of any size.
ID_DIGITS = 10
#: Ids written per step while the column is built (the step's scratch: 8 bytes a digit).
_ID_CHUNK = 1 << 16
#: The stamps' "mtime" of sample 0 (ns) and the spacing of the samples' stamps.
_EPOCH_NS = 1_700_000_000 * 10**9
_SIZE_MUL = 2_654_435_761  # Knuth's multiplicative hash: file sizes that look random


@dataclass(frozen=True)
class SyntheticPipeline:
    """The processing of a :class:`SyntheticSource`: nothing, with a fingerprint (part of
    every key) that ``version`` changes, as a pipeline parameter would."""

    version: int = 1

    @property
    def stages(self) -> tuple[Stage, ...]:
        """None: a synthetic sample is its index (what a source of bytes would run)."""
        return ()

    def fingerprint(self) -> str:
        return f"mmcache.synthetic:v{self.version}"


class SyntheticSource(BaseSource):
    """``n`` samples with ids and stamps and no bytes (see the module docstring).

    Args:
        n: samples.
        ids: ``"strings"`` (``"s"`` and ten digits, held as a UTF-8 column) or
            ``"positions"`` (the index as a decimal string, nothing held).
        stamp_kind: ``StampKind.FILE`` (four stat fields per sample, re-checked by the
            loader every epoch as a file's would be) or ``StampKind.FIXED``.
        pipeline: the fingerprint's owner (default :class:`SyntheticPipeline`).
        on_error: ``"raise"`` or ``"skip"`` for a sample that cannot be produced.
        bad: a sample whose ``produce`` raises :class:`SampleError` (None: none).
        check_ids: look for a repeated id when opened, as every source of user ids does
            (the ids are distinct by construction: False leaves out that cost, ~0.3 us a
            sample, where opening is not what is measured).
    """

    def __init__(
        self,
        n: int,
        *,
        ids: Literal["strings", "positions"] = "strings",
        stamp_kind: StampKind = StampKind.FILE,
        pipeline: SyntheticPipeline | None = None,
        on_error: OnError = "raise",
        bad: int | None = None,
        check_ids: bool = True,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"n must be an int >= 0, got {n!r}")
        if stamp_kind not in (StampKind.FILE, StampKind.FIXED):  # (a str enum: "file" is FILE)
            raise ConfigError(
                f"stamp_kind must be StampKind.FILE or StampKind.FIXED, got {stamp_kind!r}"
            )
        stamp_kind = StampKind(stamp_kind)
        if ids == "strings":
            column = string_ids(n)
            found = column.duplicate_pair() if check_ids else None
            if found is not None:  # (never: the ids are distinct by construction)
                first, later = found
                raise ManifestError(
                    duplicate_message(f"sample {first}"),
                    path="<synthetic>",
                    sample_id=column.id(later),
                )
        elif ids == "positions":
            column = IdColumn(n)
        else:
            raise ConfigError(f"ids must be 'strings' or 'positions', got {ids!r}")
        self.stamp_kind = stamp_kind
        self.bad = bad
        # The samples touched since the source was opened and how often (sorted indices).
        self._touched = np.zeros(0, dtype=np.int64)
        self._times = np.zeros(0, dtype=np.int64)
        super().__init__(pipeline=pipeline or SyntheticPipeline(), ids=column, on_error=on_error)

    @property
    def nbytes(self) -> int:
        """Bytes this source holds for its samples (the id column; touches aside)."""
        buf, off = self._ids.buffer, self._ids.offsets
        return (0 if buf is None else buf.nbytes) + (0 if off is None else off.nbytes)

    def touch(self, index: int) -> None:
        """Change sample ``index``'s stamp, as a rewrite of its file would (its key changes)."""
        idx = self._checked([index])
        at = int(np.searchsorted(self._touched, idx[0]))
        if at < self._touched.size and self._touched[at] == idx[0]:
            self._times[at] += 1
        else:
            self._touched = np.insert(self._touched, at, idx[0])
            self._times = np.insert(self._times, at, 1)

    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """``int64 [n, 4]``: size, mtime, ctime and inode of a file that would hold each
        sample (``FILE``), or ``int64 [n, 1]``: the sample's version (``FIXED``)."""
        idx = self._checked(indices)
        times = np.zeros(idx.shape[0], dtype=np.int64)
        if self._touched.size and idx.size:
            at = np.minimum(np.searchsorted(self._touched, idx), self._touched.size - 1)
            found = self._touched[at] == idx
            times[found] = self._times[at[found]]
        if self.stamp_kind is StampKind.FIXED:
            return times.reshape(-1, 1)
        out = np.empty((idx.shape[0], len(keys.STAT_FIELDS)), dtype=np.int64)
        out[:, 0] = 1024 + (idx * _SIZE_MUL) % 65536
        out[:, 1] = _EPOCH_NS + idx * 1000 + times
        out[:, 2] = out[:, 1]
        out[:, 3] = idx + 1
        return out

    def stamp_string(self, index: int, stamp: npt.NDArray[np.int64]) -> str:
        """The stamp's fields as :func:`mmcache.keys.fields_stamp` writes a file's."""
        return keys.fields_stamp(stamp.tolist())

    def produce(self, index: int) -> dict[str, np.ndarray]:
        """``{"index": int64 [1]}``: the sample's index (all a batch needs to be checked)."""
        (i,) = self._checked([index]).tolist()
        if i == self.bad:
            raise SampleError("synthetic bad sample", sample_id=self._ids.id(i))
        return {"index": np.array([i], dtype=np.int64)}


def string_ids(n: int) -> IdColumn:
    """Ids ``"s0000000000"``, ``"s0000000001"``... of ``n`` samples as one column, written
    ``_ID_CHUNK`` at a time (no Python object per sample)."""
    width = 1 + ID_DIGITS
    buf = np.empty(n * width, dtype=np.uint8)
    rows = buf.reshape(n, width)
    rows[:, 0] = ord("s")
    scale = 10 ** np.arange(ID_DIGITS - 1, -1, -1, dtype=np.int64)
    for start in range(0, n, _ID_CHUNK):
        idx = np.arange(start, min(start + _ID_CHUNK, n), dtype=np.int64)
        rows[start : start + idx.size, 1:] = (idx[:, None] // scale) % 10 + ord("0")
    offsets = np.arange(n + 1, dtype=np.int64) * width
    return IdColumn(n, buf, offsets)
