"""The CLI's options for a shared tier: ``--shared URL`` (and ``--shared-options JSON``) on
``stats``, ``gc`` and ``warm`` (with ``--ray``), and what ``stats --shared`` and
``gc --shared`` print.

A thin layer over :mod:`mmcache.shared.maintenance`, kept apart from ``cli.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Callable
from typing import Any

from mmcache.errors import ConfigError

__all__ = [
    "add_shared_options",
    "add_warm_options",
    "on_share",
    "shared_gc",
    "shared_options",
    "shared_stats",
    "shared_tier",
]


def add_shared_options(p: argparse.ArgumentParser, what: str) -> None:
    """``--shared URL`` (``what`` it does with it) and ``--shared-options JSON``."""
    p.add_argument(
        "--shared",
        metavar="URL",
        help=f"a shared tier: a folder on a shared file system or s3://bucket/prefix ({what})",
    )
    p.add_argument(
        "--shared-options",
        metavar="JSON",
        help="storage_options (object store options) of the shared tier, e.g. '{\"anon\": false}'",
    )


def add_warm_options(p: argparse.ArgumentParser) -> None:
    """``warm``'s ``--shared URL``, ``--shared-options`` and ``--ray``."""
    add_shared_options(p, "publish what is produced there too")
    p.add_argument(
        "--ray",
        action="store_true",
        help="produce on Ray tasks (pip install 'mmcache[ray]'; the cluster ray.init() finds) "
        "into the --shared tier, instead of --workers processes here",
    )


def shared_tier(args: argparse.Namespace) -> Any:
    """The :class:`~mmcache.shared.SharedTier` of ``--shared`` (None without it); a
    ConfigError for ``--ray`` without one."""
    if args.shared is None:  # (warm's parser: add_warm_options)
        if args.ray:
            raise ConfigError("--ray fills a shared tier: pass --shared URL")
        return None
    from mmcache.shared import SharedTier

    return SharedTier(args.shared, storage_options=shared_options(args))


def shared_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--shared-options`` as a dict (a ConfigError naming the option when not JSON)."""
    text = args.shared_options  # (every parser of --shared: add_shared_options)
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--shared-options must be a JSON object: {exc}") from None
    if not isinstance(options, dict):
        raise ConfigError(f"--shared-options must be a JSON object, got {type(options).__name__}")
    return options


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M") if t else "-"


def on_share(args: argparse.Namespace, command: str, print_json: Callable[[Any], None]) -> bool:
    """Run ``command`` (``stats`` or ``gc``) on ``--shared URL`` if given and say so;
    False without ``--shared`` (the command then needs ``--cache``: a ConfigError if
    missing for ``stats``; ``gc`` checks its own)."""
    if args.shared is None:
        if command == "stats" and args.cache is None:
            raise ConfigError("stats needs --cache ROOT or --shared URL")
        return False
    if args.cache is not None:
        raise ConfigError(
            f"{command}: pass --cache ROOT or --shared URL, not both (a share is not a cache root)"
        )
    out: dict[str, Any] | None = {} if args.json else None
    (shared_stats if command == "stats" else shared_gc)(args, out)
    if out is not None:
        print_json(out["shared"])
    return True


def shared_stats(args: argparse.Namespace, out: dict[str, Any] | None) -> None:
    """Print (or, with ``out``, add to the JSON ``out``) the share's counts."""
    from mmcache.shared.maintenance import share_stats
    from mmcache.units import format_size

    stats = share_stats(args.shared, storage_options=shared_options(args))
    if out is not None:
        out["shared"] = stats.as_dict()
        return
    print(
        f"shared tier {stats.url}: {stats.packs} packs, {stats.entries} entries, "
        f"{format_size(stats.bytes)} (indexes {format_size(stats.index_bytes)}); "
        f"entries made {_when(stats.oldest)} .. {_when(stats.newest)}; "
        f"{stats.uncommitted} packs without an index ({format_size(stats.uncommitted_bytes)})"
        + (f"; {len(stats.damaged)} damaged indexes" if stats.damaged else "")
    )


def shared_gc(args: argparse.Namespace, out: dict[str, Any] | None) -> None:
    """Run ``gc`` on the share; print (or add to ``out``) what it removed."""
    from mmcache.shared.maintenance import gc_share
    from mmcache.units import format_size

    report = gc_share(args.shared, older_than=args.older_than, storage_options=shared_options(args))
    if out is not None:
        out["shared"] = report.as_dict()
        return
    print(
        f"shared tier {report.url}: freed {format_size(report.freed_bytes)}: {report.packs} "
        f"packs of {report.entries} entries older than {args.older_than or 'never'}, "
        f"{report.uncommitted} packs without an index, {report.damaged} damaged indexes"
    )
