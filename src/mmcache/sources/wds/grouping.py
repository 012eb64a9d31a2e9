"""The members of one shard grouped into samples by key, as WebDataset groups them.

A member ``dir/000123.jpg`` belongs to key ``dir/000123``: the name up to the first dot
of its last component (:func:`split_name`, WebDataset's ``base_plus_ext``); its
extension, lower-cased, gives its role (image, text or json: the first role listing it)
and its rank in that role (the first extension listed wins the role when a key has
several). A member name repeated within the shard leaves its key out (which copy is
meant cannot be told). Keys come in the order they first appear.

Two ways to the one answer: the names of a usual shard (all different, no newline)
are split without a regex and without remembering the names seen (~1 us a member);
any other shard's go through :func:`split_name` and a set of the names seen, which
finds the repeated ones. Tests hold the two to the same answer.

Pure functions; thread-safe.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Grouped", "group", "split_name"]

_NAME_RE = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
#: Extensions of each role, lower case, in order of preference (image, text, json).
Exts = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]
_ROLES = 3
_NONE = 1 << 62  # no member of this role yet: any rank is better


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, extension)`` of a member name (extension lower-cased), or ``None`` for a
    name without one (WebDataset ignores those too)."""
    m = _NAME_RE.match(name)
    if m is None:
        return None
    return m.group(1), m.group(2).lower()


@dataclass(frozen=True)
class Grouped:
    """The samples of a shard: their keys (one UTF-8 buffer and ``n + 1`` offsets), the
    member chosen for each role (int64 ``[n, 3]``, -1: none) and its extension's number
    in that role's list, the role of each sample's first member, and ``(key, member)``
    of each member repeated within the shard (its key left out)."""

    id_buf: npt.NDArray[np.uint8]
    id_off: npt.NDArray[np.int64]
    best: npt.NDArray[np.int64]
    number: npt.NDArray[np.int64]
    first_role: npt.NDArray[np.int64]
    repeated: tuple[tuple[str, str], ...]


def roles(exts: Exts) -> dict[str, tuple[int, int, int]]:
    """``extension -> (role, rank, number)``: its rank in the role (the last place of an
    extension listed twice, as a dict keeps it) and its number (the first: list.index);
    the first role listing an extension takes it."""
    out: dict[str, tuple[int, int, int]] = {}
    for role, listed in enumerate(exts):
        ranks = {e: r for r, e in enumerate(listed)}
        for e, r in ranks.items():
            out.setdefault(e, (role, r, listed.index(e)))
    return out


class _Groups:
    """The samples found so far, as flat lists of ints (three per sample: one per role),
    never a container per sample: a shard's first open makes tens of thousands, and
    each would be one more object for the garbage collector to walk."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}  # key -> sample number
        self.best: list[int] = []  # member chosen per role (-1: none)
        self.rank: list[int] = []  # its rank in the role
        self.number: list[int] = []  # its extension's number in the role's list
        self.first_role: list[int] = []

    def add(self, key: str, member: int, role: int, rank: int, number: int) -> None:
        """Member ``member`` of ``key``: kept for ``role`` if its rank is the best yet."""
        g = self.index.get(key)
        if g is None:
            g = self.index[key] = len(self.first_role)
            self.first_role.append(role)
            self.best += (-1, -1, -1)
            self.rank += (_NONE, _NONE, _NONE)
            self.number += (-1, -1, -1)
        at = 3 * g + role
        if rank < self.rank[at]:
            self.best[at], self.rank[at], self.number[at] = member, rank, number


def group(names: Sequence[str], exts: Exts) -> Grouped:
    """The samples of a shard whose members are ``names`` (see the module docstring);
    ``exts`` lower case."""
    role_of = roles(exts)
    groups = _Groups()
    joined = "".join(names)
    if len(set(names)) == len(names) and "\n" not in joined:
        _plain(names, role_of, groups, flat="/" not in joined)
        repeated: dict[str, str] = {}
    else:
        repeated = _any(names, role_of, groups)
    best = np.array(groups.best, dtype=np.int64).reshape(-1, _ROLES)
    number = np.array(groups.number, dtype=np.int64).reshape(-1, _ROLES)
    first_role = np.array(groups.first_role, dtype=np.int64)
    keys = list(groups.index)
    if repeated:  # their samples are left out
        keep = [g for g, key in enumerate(keys) if key not in repeated]
        best, number, first_role = best[keep], number[keep], first_role[keep]
        keys = [keys[g] for g in keep]
    joined = "".join(keys)
    if joined.isascii():  # a character a byte: the lengths are the keys' lengths
        encoded, lengths = joined.encode("ascii"), list(map(len, keys))
    else:
        parts = [key.encode("utf-8", "surrogatepass") for key in keys]
        encoded, lengths = b"".join(parts), list(map(len, parts))
    id_off = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum(lengths, out=id_off[1:])
    return Grouped(
        id_buf=np.frombuffer(encoded, dtype=np.uint8).copy(),
        id_off=id_off,
        best=best,
        number=number,
        first_role=first_role,
        repeated=tuple(repeated.items()),
    )


def _plain(
    names: Sequence[str],
    role_of: dict[str, tuple[int, int, int]],
    groups: _Groups,
    *,
    flat: bool,
) -> None:
    """The groups of names that are all different and hold no newline (``flat``: and no
    slash): split_name without its regex, nothing to remember of the names seen, and
    :meth:`_Groups.add` written out (the path of every usual shard: it runs for every
    member)."""
    get = role_of.get
    index, best, ranks, numbers, first = (
        groups.index,
        groups.best,
        groups.rank,
        groups.number,
        groups.first_role,
    )
    for i, name in enumerate(names):
        if flat:  # no folders: the first dot splits
            dot = name.find(".")
            if dot <= 0:
                continue  # no dot, or the name starts with one
        else:
            slash = name.rfind("/") + 1
            dot = name.find(".", slash)
            if dot <= slash:
                continue  # no dot, or the last component starts with one
        ext = name[dot + 1 :]
        found = get(ext)  # the listed extensions are lower case: most names' are too
        if found is None:
            found = get(ext.lower())
            if found is None:
                continue
        role, rank, number = found
        key = name[:dot]
        g = index.get(key)
        if g is None:
            g = index[key] = len(first)
            first.append(role)
            best += (-1, -1, -1)
            ranks += (_NONE, _NONE, _NONE)
            numbers += (-1, -1, -1)
        at = 3 * g + role
        if rank < ranks[at]:
            best[at], ranks[at], numbers[at] = i, rank, number


def _any(
    names: Sequence[str], role_of: dict[str, tuple[int, int, int]], groups: _Groups
) -> dict[str, str]:
    """The groups of any names; returns the keys of the members repeated (the member)."""
    seen: set[str] = set()
    repeated: dict[str, str] = {}
    for i, name in enumerate(names):
        split = split_name(name)
        if split is None:
            continue
        key, ext = split
        found = role_of.get(ext)
        if found is None:
            continue
        if name in seen:
            repeated.setdefault(key, name)
            continue
        seen.add(name)
        groups.add(key, i, *found)
    return repeated
