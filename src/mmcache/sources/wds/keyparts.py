"""What the keys of a :class:`~mmcache.sources.wds.WebDatasetSource` depend on besides each
stamp row: the identity of its node-shared key table (:mod:`~mmcache.sources.keytable`).

A table row is indexed by sample number and used when its check verifies and its stamp
row (the shard's stamp digest, the offsets and sizes of the image and text members)
equals the sample's now. So the identity must change whenever number ``i`` could denote
another sample or another key text. It holds:

- every shard's location, in order, with its stamp and size as the member index saw
  them when the source was opened (a shard rewritten, removed or added shifts the
  numbers of later shards while their own stamps stay the same);
- the digest of every id in order (:meth:`~mmcache.sources.ids.IdColumn.digest`: one
  xxh3 pass over the id buffer, ~1 ms per 10^6 ids; the open hashes every id once
  already to find repeated keys), which also covers the samples a re-indexed shard
  kept under their old numbers;
- the extensions of each role (which member is a sample's image or text, and the
  extension number in the key's layout), ``on_error`` (which repeated keys and
  unreadable shards are left out) and the bound over which a span's identity is its
  shard's evidence instead of its bytes' digest.

The key text is the span's bytes' identity and layout (the caption is a member of the
span): nothing beyond the stamp row and the above. Only local shards have a table: a
remote shard's key is its ETag and span, safe the same way, but left to the private
memo until its revalidation across runs is covered by tests.

The table is watched (:func:`~mmcache.sources.keytable.sweep_tables`) by the ``stat``
stamps of up to :data:`WATCHED` of the shards, spread over the list (first and last
included): one of them rewritten or removed sweeps it at the next table made on the
node; a change to another one makes a new table too, and the old one goes after
:data:`~mmcache.sources.keytable.UNUSED_SECONDS`.

Thread/process safety: pure functions of the source's opened state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from mmcache.sources import identity

__all__ = ["WATCHED", "racy_shards", "table_parts"]

#: Most shards whose ``stat`` stamp a table's header watches (it fits the 4 KiB header).
WATCHED = 16
#: Most bytes of shard paths in a watch (long paths: fewer shards watched).
_WATCH_BYTES = 2048


def table_parts(
    *,
    locations: Sequence[str],
    stamps: Sequence[str],
    sizes: Sequence[int],
    ids_digest: str,
    n: int,
    exts: Sequence[Sequence[str]],
    on_error: str,
) -> tuple[Any, list[Any]]:
    """``(what, watch)`` for :meth:`~mmcache.sources.chassis.BaseSource.key_table_parts`
    of local shards ``locations`` opened at ``stamps`` (``""``: left out, unreadable) and
    ``sizes``, whose ``n`` samples' ids have ``ids_digest``."""
    what = [
        "wds",
        list(locations),
        list(stamps),
        [int(s) for s in sizes],
        ids_digest,
        n,
        [list(e) for e in exts],
        on_error,
        identity.MAX_DIGEST_BYTES,
    ]
    return what, ["stat", _watched(locations, stamps)]


def _watched(locations: Sequence[str], stamps: Sequence[str]) -> list[list[str]]:
    """``[path, stat stamp]`` of up to :data:`WATCHED` opened shards spread evenly."""
    opened = [s for s in range(len(locations)) if stamps[s]]
    if len(opened) > WATCHED:
        picks = np.linspace(0, len(opened) - 1, WATCHED).round().astype(int).tolist()
        opened = [opened[p] for p in dict.fromkeys(picks)]
    out: list[list[str]] = []
    used = 0
    for s in opened:
        used += len(locations[s].encode()) + len(stamps[s]) + 8
        if used > _WATCH_BYTES:
            break
        out.append([locations[s], stamps[s]])
    return out


def racy_shards(stamps: Sequence[str], taken: float) -> npt.NDArray[np.bool_]:
    """Per shard: whether its ``stat`` stamp (``size:mtime_ns:ctime_ns:inode``) changed
    less than :data:`~mmcache.sources.identity.RACY_SECONDS` before ``taken`` (a rewrite
    in the same clock tick keeps every field: its samples' keys are not remembered
    yet). A shard without a stamp is not (its samples have no members)."""
    fields = np.zeros((len(stamps), 4), dtype=np.int64)
    for s, stamp in enumerate(stamps):
        parts = stamp.split(":") if stamp else []
        if len(parts) == 4:
            fields[s] = [int(p) for p in parts]
    young: npt.NDArray[np.bool_] = identity.racy_rows(fields, taken)
    return young
