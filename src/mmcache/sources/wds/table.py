"""Shard patterns to shard lists, and the members of indexed shards grouped into samples
by key, as WebDataset groups them, in a columnar table.

:func:`expand_shards` turns a path, a glob, a brace pattern (``shards/{00000..00099}.tar``,
through ``braceexpand``) or a list of them into shard locations. :class:`SampleTable`
holds one row per sample key (``dir/000123`` of ``dir/000123.jpg``, ``.txt``, ``.json``:
the part of the name before the first dot of its last component, as WebDataset's
``base_plus_ext``): which shard, the image member's offset, size and extension, the text
member's offset and size, and the ``width``/``height`` of its ``.json`` member, as numpy
columns (a source holding it pickles cheaply; no per-sample Python objects).

Duplicate keys (the same key in two shards, or a member repeated in one shard) and
unreadable shards are found here: :meth:`SampleTable.add_shard` returns them as
problems; the source raises or skips them.

Not thread-safe while being built; read-only after :meth:`SampleTable.finish`.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mmcache.errors import ConfigError
from mmcache.sources.ids import IdColumn, duplicate_message
from mmcache.sources.remote.fs import is_remote
from mmcache.sources.wds.index import ShardIndex

__all__ = ["Problem", "SampleTable", "expand_shards", "split_name"]

_NAME_RE = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
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


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member name (extension lower-cased), or ``None`` for a
    name without one (WebDataset ignores those too)."""
    m = _NAME_RE.match(name)
    if m is None:
        return None
    return m.group(1), m.group(2).lower()


@dataclass(frozen=True)
class Problem:
    """A member or shard the table could not take: its key (``None`` for a whole shard),
    the shard, the member and why."""

    key: str | None
    shard: str
    member: str | None
    reason: str


class SampleTable:
    """Samples of the shards added so far (see the module docstring)."""

    def __init__(
        self, *, image_exts: Sequence[str], text_exts: Sequence[str], json_exts: Sequence[str]
    ) -> None:
        self.image_exts = tuple(e.lower() for e in image_exts)
        self.text_exts = tuple(e.lower() for e in text_exts)
        self.json_exts = tuple(e.lower() for e in json_exts)
        self._rows: list[tuple[int, int, int, int, int, int, int, int, int]] = []
        self._ids: list[str] = []
        self._where: dict[str, str] = {}  # key -> "shard S, member M" of its first occurrence

    @staticmethod
    def group(
        index: ShardIndex,
        image_exts: Sequence[str],
        text_exts: Sequence[str],
        json_exts: Sequence[str],
    ) -> tuple[dict[str, dict[str, tuple[str, int, int]]], list[Problem]]:
        """``key -> {role: (member, offset, size)}`` of one shard (roles ``image``, ``text``,
        ``json``; the first extension listed wins a role), in first-seen order, and the
        members repeated within the shard (their samples are left out of the groups)."""
        groups: dict[str, dict[str, tuple[str, int, int]]] = {}
        seen: set[str] = set()
        repeated: set[str] = set()
        problems: list[Problem] = []
        ranks = {
            "image": {e: r for r, e in enumerate(image_exts)},
            "text": {e: r for r, e in enumerate(text_exts)},
            "json": {e: r for r, e in enumerate(json_exts)},
        }
        best: dict[tuple[str, str], int] = {}
        for name, offset, size in zip(index.names, index.offsets, index.sizes, strict=True):
            split = split_name(name)
            if split is None:
                continue
            key, ext = split
            role = next((r for r, exts in ranks.items() if ext in exts), None)
            if role is None:
                continue
            if name in seen:
                if key not in repeated:
                    problems.append(
                        Problem(
                            key,
                            index.location,
                            name,
                            "member repeated within the shard: the sample is left out "
                            "(which copy is meant cannot be told)",
                        )
                    )
                repeated.add(key)
                continue
            seen.add(name)
            members = groups.setdefault(key, {})
            rank = ranks[role][ext]
            if (key, role) not in best or rank < best[(key, role)]:
                best[(key, role)] = rank
                members[role] = (name, offset, size)
        for key in repeated:  # listed as rejected, so never served
            groups.pop(key, None)
        return groups, problems

    def add_shard(self, shard: int, index: ShardIndex) -> list[Problem]:
        """Add the samples of shard number ``shard``; the keys already seen in an earlier
        shard are left out and returned as problems."""
        groups, problems = self.group(index, self.image_exts, self.text_exts, self.json_exts)
        for key, members in groups.items():
            first = self._where.get(key)
            member = next(iter(members.values()))[0]
            if first is not None:  # the first is kept (sources/ids.py: one rule for all)
                problems.append(Problem(key, index.location, member, duplicate_message(first)))
                continue
            self._where[key] = f"shard {index.location}, member {member}"
            img = members.get("image")
            txt = members.get("text")
            js = members.get("json")
            width, height = index.dims.get(js[0], (-1, -1)) if js is not None else (-1, -1)
            ext = text_ext = -1
            if img is not None:
                split = split_name(img[0])
                ext = self.image_exts.index(split[1]) if split is not None else -1
            if txt is not None:
                split = split_name(txt[0])
                text_ext = self.text_exts.index(split[1]) if split is not None else -1
            self._rows.append(
                (
                    shard,
                    img[1] if img else -1,
                    img[2] if img else -1,
                    txt[1] if txt else -1,
                    txt[2] if txt else -1,
                    ext,
                    width,
                    height,
                    text_ext,
                )
            )
            self._ids.append(key)
        return problems

    def finish(self) -> SampleColumns:
        """The table as numpy columns."""
        rows = np.array(self._rows, dtype=np.int64).reshape(-1, 9)
        encoded = [s.encode("utf-8", "surrogatepass") for s in self._ids]
        lengths = np.array([len(b) for b in encoded], dtype=np.int64)
        id_off = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum(lengths, out=id_off[1:])
        id_buf = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
        return SampleColumns(rows, id_buf, id_off)


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
