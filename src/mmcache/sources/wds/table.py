"""Shard patterns to shard lists, and the members of indexed shards grouped into samples
by key, as WebDataset groups them, in a columnar table.

:func:`expand_shards` turns a path, a glob, a brace pattern (``shards/{00000..00099}.tar``,
through ``braceexpand``) or a list of them into shard locations. :class:`ShardTable`
holds one shard's samples, one row per key (``dir/000123`` of ``dir/000123.jpg``,
``.txt``, ``.json``: the part of the name before the first dot of its last component, as
WebDataset's ``base_plus_ext``): the image member's offset, size and extension, the
text member's offset and size, and the ``width``/``height`` of its ``.json`` member, as
numpy columns; what the member index file keeps (:mod:`~mmcache.sources.wds.tablefile`).
:func:`assemble` puts the shards' tables together into :class:`SampleColumns`, the
source's table (no per-sample Python objects: a source holding it pickles cheaply).

Duplicate keys (the same key in two shards, or a member repeated in one shard) are found
here, as problems: the source raises or skips them.

Read-only once made; a :class:`ShardTable` is made by one thread.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, cast

import numpy as np
import numpy.typing as npt

from mmcache.errors import ConfigError
from mmcache.sources.blobs.objects import is_remote
from mmcache.sources.ids import IdColumn, duplicate_message
from mmcache.sources.wds import grouping
from mmcache.sources.wds.grouping import Exts, split_name

__all__ = [
    "Exts",
    "Problem",
    "SampleColumns",
    "ShardIndex",
    "ShardTable",
    "assemble",
    "expand_shards",
    "split_name",
]

_GLOB_CHARS = frozenset("*?[")


def expand_shards(shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """Shard locations of ``shards``: brace patterns expanded, local globs matched (sorted),
    local paths made absolute; URLs kept as they are. ConfigError when nothing is left
    or a local glob matches nothing."""
    items = [shards] if isinstance(shards, str | os.PathLike) else list(shards)
    out: list[str] = []
    for item in items:
        text = os.fspath(item)
        expanded = [text]
        if "{" in text:
            try:
                from braceexpand import braceexpand
            except ImportError as exc:  # pragma: no cover - declared by the wds extra
                raise ConfigError(
                    f"brace pattern {text!r} needs braceexpand: pip install 'mmcache[wds]'"
                ) from exc
            expanded = list(braceexpand(text))
        for one in expanded:
            if is_remote(one):
                out.append(one)
            elif _GLOB_CHARS & set(one):
                found = sorted(glob.glob(os.path.expanduser(one)))
                if not found:
                    raise ConfigError(f"shard pattern {one!r} matches no file")
                out.extend(os.path.abspath(f) for f in found)
            else:
                out.append(os.path.abspath(os.path.expanduser(one)))
    if not out:
        raise ConfigError(f"no shards in {shards!r}")
    if len(set(out)) != len(out):
        raise ConfigError("a shard is listed twice")
    return out


# The members of one shard, as its index (index.py) gives them; defined here, beside the
# table grouped from it, so that this module never imports index.py (which imports it).
@dataclass(frozen=True)
class ShardIndex:
    """The members of one shard (tar order): names, data offsets, sizes; the ``width`` and
    ``height`` of each ``.json`` member that has them (by member number); whether the
    shard was cut short."""

    location: str
    stamp: str
    size: int
    names: Sequence[str]
    offsets: Sequence[int]
    sizes: Sequence[int]
    dims: dict[int, tuple[int, int]]
    truncated: bool


@dataclass(frozen=True)
class Problem:
    """A member or shard the table could not take: its key (``None`` for a whole shard),
    the shard, the member and why."""

    key: str | None
    shard: str
    member: str | None
    reason: str


@dataclass(frozen=True)
class ShardTable:
    """The samples of one shard version, grouped by key for one choice of extensions
    (:meth:`group`): what a source keeps of a shard, and what its member index file
    holds (:mod:`~mmcache.sources.wds.tablefile`).

    ``rows`` is int64 ``[n, 10]``: :class:`SampleColumns`' columns 1-8 (image offset,
    size, text offset, size, image extension number, width, height, text extension
    number; -1 where absent), then the role of the sample's first member (0 image, 1
    text, 2 json: the member a duplicate key names) and its json extension number. The
    keys are one UTF-8 buffer with offsets; ``repeated`` lists ``(key, member)`` of the
    members repeated within the shard (their samples are left out)."""

    location: str
    stamp: str
    size: int
    truncated: bool
    members: int
    exts: Exts
    rows: npt.NDArray[np.int64]
    id_buf: npt.NDArray[np.uint8]
    id_off: npt.NDArray[np.int64]
    repeated: tuple[tuple[str, str], ...]

    COLUMNS: ClassVar[int] = 10
    FIRST_ROLE, JSON_EXT = 8, 9

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def key(self, i: int) -> str:
        return bytes(self.id_buf[self.id_off[i] : self.id_off[i + 1]]).decode(
            "utf-8", "surrogatepass"
        )

    def first_member(self, i: int) -> str:
        """``key.ext`` of sample ``i``'s first member (the extension as listed)."""
        role = int(self.rows[i, self.FIRST_ROLE])
        number = int(self.rows[i, (C.EXT - 1, C.TXT_EXT - 1, self.JSON_EXT)[role]])
        return f"{self.key(i)}.{self.exts[role][number]}"

    @classmethod
    def group(cls, index: ShardIndex, exts: Exts) -> ShardTable:
        """The samples of ``index``, its members grouped by key as WebDataset groups them
        (:mod:`~mmcache.sources.wds.grouping`), in order of first appearance."""
        g = grouping.group(index.names, exts)
        n = g.best.shape[0]
        offsets = np.asarray(index.offsets, dtype=np.int64)
        sizes = np.asarray(index.sizes, dtype=np.int64)
        rows = np.full((n, cls.COLUMNS), -1, dtype=np.int64)
        for role, col in ((0, 0), (1, 2)):  # image, text: offset and size
            have = g.best[:, role] >= 0
            rows[have, col] = offsets[g.best[have, role]]
            rows[have, col + 1] = sizes[g.best[have, role]]
        rows[:, C.EXT - 1] = g.number[:, 0]
        rows[:, C.TXT_EXT - 1] = g.number[:, 1]
        rows[:, cls.JSON_EXT] = g.number[:, 2]
        rows[:, cls.FIRST_ROLE] = g.first_role
        dims = index.dims
        if dims:
            found = [(i, dims[js]) for i, js in enumerate(g.best[:, 2].tolist()) if js in dims]
            if found:
                at, wh = zip(*found, strict=True)
                rows[list(at), C.WIDTH - 1 : C.HEIGHT] = wh
        return cls(
            location=index.location,
            stamp=index.stamp,
            size=index.size,
            truncated=index.truncated,
            members=len(index.names),
            exts=exts,
            rows=rows,
            id_buf=g.id_buf,
            id_off=g.id_off,
            repeated=g.repeated,
        )

    def problems(self) -> list[Problem]:
        """The members repeated within the shard, as problems."""
        reason = (
            "member repeated within the shard: the sample is left out "
            "(which copy is meant cannot be told)"
        )
        return [Problem(key, self.location, member, reason) for key, member in self.repeated]


def assemble(tables: Sequence[tuple[int, ShardTable]]) -> tuple[SampleColumns, list[Problem]]:
    """The samples of ``(shard number, table)`` pairs, in that order, as one table, and
    the keys found again in a later shard (the first is kept: sources/ids.py's one
    rule), as problems in shard order. One array operation per shard and one over all
    keys (:meth:`IdColumn.duplicates`): no Python object per sample."""
    n = sum(len(t) for _, t in tables)
    rows = np.empty((n, 9), dtype=np.int64)
    id_off = np.zeros(n + 1, dtype=np.int64)
    at = 0
    for shard, table in tables:
        k = len(table)
        rows[at : at + k, C.SHARD] = shard
        rows[at : at + k, 1:] = table.rows[:, : C.TXT_EXT]
        id_off[at + 1 : at + k + 1] = table.id_off[1:] + id_off[at]
        at += k
    buffers = [t.id_buf for _, t in tables]
    id_buf = np.concatenate(buffers) if buffers else np.zeros(0, dtype=np.uint8)
    ids = IdColumn(n, id_buf, id_off)
    pairs = ids.duplicates()
    if not pairs:
        return SampleColumns(rows, id_buf, id_off), []
    # where each sample came from, to name the members of a duplicate
    starts = np.cumsum([0] + [len(t) for _, t in tables])

    def origin(i: int) -> tuple[ShardTable, int]:
        j = int(np.searchsorted(starts, i, side="right")) - 1
        return tables[j][1], i - int(starts[j])

    problems = []
    for first, later in pairs:
        table, row = origin(first)
        where = f"shard {table.location}, member {table.first_member(row)}"
        table, row = origin(later)
        problems.append(
            Problem(
                table.key(row), table.location, table.first_member(row), duplicate_message(where)
            )
        )
    keep = np.setdiff1d(np.arange(n), [later for _, later in pairs])
    kept = ids.take(keep)  # a column of strings stays one: its arrays are there
    buf, off = cast("npt.NDArray[np.uint8]", kept.buffer), cast("np.ndarray", kept.offsets)
    return SampleColumns(rows[keep], buf, off), problems


class SampleColumns:
    """The finished table: ``rows`` int64 ``[n, 9]`` (shard, image offset, image size, text
    offset, text size, image extension number, width, height, text extension number; -1
    where absent) and the ids as one utf-8 buffer with offsets."""

    SHARD, IMG_OFF, IMG_LEN, TXT_OFF, TXT_LEN, EXT, WIDTH, HEIGHT, TXT_EXT = range(9)

    def __init__(self, rows: np.ndarray, id_buf: np.ndarray, id_off: np.ndarray) -> None:
        self.rows = rows
        self.id_buf = id_buf
        self.id_off = id_off
        #: The keys as every source holds its ids (sources/ids.py).
        self.id_column = IdColumn(int(rows.shape[0]), id_buf, id_off)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def id(self, i: int) -> str:
        return self.id_column.id(i)

    def ids_digest(self) -> str:
        return self.id_column.digest()


C = SampleColumns
