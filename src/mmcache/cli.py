"""Command-line interface: a thin argparse layer over the library.

``mmcache demo | synth | warm | bench | stats | verify | gc | inspect``; ``--help`` on each.
Sizes accept IEC units (``512MiB``, ``10GiB``), durations s/m/h/d (``7d``).
Commands whose output is data take ``--json``. ``--version`` says which copy runs.
Exit status: 0, 1 (a check found problems), 2 (an error, on one line), 141 (the
reader of the output went away: ``mmcache stats | head``, quietly).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmcache.cliargs import (
    Parser,
    add_data_options,
    add_pipeline_options,
    data_options,
    duration,
    glue_dash_values,
    int_at_least,
    print_json,
    size_of,
    table,
)
from mmcache.clidemo import add_bench_parser, add_demo_parser
from mmcache.cliinspect import add_inspect_parser
from mmcache.clishared import add_shared_options, add_warm_options, on_share, shared_tier

__all__ = ["build_parser", "main"]

logger = logging.getLogger(__name__)


# -- synth --------------------------------------------------------------------------------
def _cmd_synth(args: argparse.Namespace) -> int:
    from mmcache.errors import ConfigError
    from mmcache.synth import make_dataset

    t0 = time.perf_counter()
    try:
        path = make_dataset(args.out, args.n, seed=args.seed, large=args.large)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the dataset to {args.out}: {exc.strerror or exc} (give a folder path)"
        ) from exc
    print(f"{args.n} samples written in {time.perf_counter() - t0:.1f}s; manifest: {path}")
    return 0


# -- warm ---------------------------------------------------------------------------------
def _pipeline_for(args: argparse.Namespace) -> Any:
    """``--pipeline``'s, else the default one from ``--size``, ``--max-length``, ``--tokenizer``."""
    from mmcache.defaults import DEFAULT_MAX_LENGTH, DEFAULT_SIZE, default_pipeline

    if args.pipeline is not None:
        return _user_pipeline(args)
    return default_pipeline(
        size=DEFAULT_SIZE if args.size is None else args.size,
        max_length=DEFAULT_MAX_LENGTH if args.max_length is None else args.max_length,
        tokenizer=args.tokenizer,
    )


def _cmd_warm(args: argparse.Namespace) -> int:
    import mmcache as mc
    from mmcache.warm import warm

    pipe = _pipeline_for(args)
    ds = mc.open_source(args.manifest, pipeline=pipe, on_error=args.on_error, **data_options(args))
    cache = _open_for_warm(args)
    try:
        if args.features:
            from mmcache.features import FeatureCache, load_factory, warm_features

            loaded = load_factory(args.features)
            feats = FeatureCache(
                loaded.encoder,
                cache=cache,
                preprocess=loaded.preprocess,
                name=loaded.name,
                version=loaded.version,
                output=loaded.output,
                memory=0,
            )
            report: Any = warm_features(ds, feats, progress=not args.json)
        else:
            report = warm(
                ds,
                cache,
                workers=args.workers,
                progress=not args.json,
                executor="ray" if args.ray else "local",
            )
    finally:
        cache.close()
    if args.json:
        print_json(report.as_dict())
    else:
        print(
            " ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in report.as_dict().items()
            )
        )
    return 0


def _user_pipeline(args: argparse.Namespace) -> Any:
    """The ``Pipeline`` that ``--pipeline module:function`` returns (the training
    script's own, so that warm fills the keys it reads)."""
    from mmcache.errors import ConfigError
    from mmcache.features.factory import load_callable
    from mmcache.transforms.pipeline import Pipeline

    given = [
        flag
        for flag, value in (
            ("--size", args.size),
            ("--max-length", args.max_length),
            ("--tokenizer", args.tokenizer),
        )
        if value is not None
    ]
    if given:
        raise ConfigError(
            f"{', '.join(given)} describe the default pipeline; with --pipeline the function "
            "returns the whole pipeline: drop them"
        )
    pipe = load_callable(args.pipeline, what="pipeline")()
    if not isinstance(pipe, Pipeline):
        raise ConfigError(
            f"--pipeline {args.pipeline} returned a {type(pipe).__name__}; it must return the "
            "mmcache.Pipeline the training script uses"
        )
    return pipe


#: The disk budget ``warm`` gives a new root when ``--disk`` is not passed.
WARM_DISK = "50GiB"


def _open_for_warm(args: argparse.Namespace) -> Any:
    """The cache ``warm`` fills, without its memory tier (no shared memory allocated).

    A root that exists keeps what ``cache.json`` records (budgets, policy, TTL):
    only an explicit ``--disk`` changes its disk budget, recorded alone, and an
    explicit ``--policy`` applies to this run. A new root records ``--disk`` (default
    ``50GiB``) and the policy, as any cache does when it is created.
    """
    import mmcache as mc
    from mmcache.cacheroot import CONFIG_FILE

    root = Path(os.path.expanduser(args.cache))
    shared = shared_tier(args)  # --shared URL: publish there too (or only, with --ray)
    if not (root / CONFIG_FILE).is_file():
        disk = WARM_DISK if args.disk is None else args.disk
        return mc.Cache(root, memory=0, disk=disk, policy=args.policy or "value", shared=shared)
    overrides: dict[str, Any] = {} if args.policy is None else {"policy": args.policy}
    overrides["shared"] = shared
    if args.disk is not None:
        overrides["disk"] = args.disk
    cache = mc.Cache.open_existing(root, memory=0, **overrides)
    if args.disk is not None:
        cache.resize_disk(args.disk)  # the user asked for it: later opens keep it
    return cache


# -- stats / verify / gc --------------------------------------------------------------------
def _open(args: argparse.Namespace) -> Any:
    """The cache at ``--cache`` with its recorded budgets; attaches the memory tier
    only if it exists and writes nothing to ``cache.json`` (see Cache.open_existing)."""
    from mmcache.cache import Cache

    return Cache.open_existing(args.cache)


def _absent(cache: Any) -> str:
    """``"memory tier: not present"`` lines for tiers with a budget that are not there
    (``"memory tier: damaged: why"`` for one that could not be opened)."""
    return "".join(
        f"\n{tier} tier: damaged: {cache.degraded[tier]}"
        if tier in cache.degraded
        else f"\n{tier} tier: not present"
        for tier in cache.absent_tiers
    )


def _ledger(prune: bool) -> tuple[Any, str | None]:
    """The node's identity ledger (:mod:`mmcache.sources.identity`), pruned if ``prune``:
    its report, or None and why it was refused (another user's ledger)."""
    from mmcache.errors import CacheError
    from mmcache.sources.identity import ledger_report, prune_ledger

    try:
        return (prune_ledger() if prune else ledger_report()), None
    except CacheError as exc:
        return None, str(exc)


def _cmd_stats(args: argparse.Namespace) -> int:
    from mmcache.maintenance import damaged_tiers
    from mmcache.stats import read_text_reports
    from mmcache.units import format_size

    if on_share(args, "stats", print_json):  # --shared URL: the share's counts
        return 0
    cache = _open(args)
    try:
        stats = cache.stats()
        absent = list(cache.absent_tiers)
        note = _absent(cache)
        damaged = {**cache.degraded, **damaged_tiers(cache.tiers)}
        note += "".join(
            f"\n{t} tier: damaged: {why}" for t, why in damaged.items() if t in cache.tiers
        )
    finally:
        cache.close()
    # SFT length passes recorded here (FileSource.text_report(root=...))
    reports = read_text_reports(os.path.expanduser(args.cache))
    book, refused = _ledger(prune=False)
    if args.json:
        texts = [r.as_dict() for r in reports]
        out = {**stats.as_dict(), "not_present": absent, "text_reports": texts}
        ident = book.as_dict() if book is not None else {"refused": refused}
        print_json({**out, "damaged": damaged, "identity_ledger": ident})
        return 0
    fields = ["items", "bytes", "budget", "hits", "misses", "evictions", "expired", "corrupt"]
    rows = []
    for tier, t in stats.tiers.items():
        d = t.as_dict()
        rows.append(
            [tier]
            + [
                format_size(d[f]) if f in ("bytes", "budget") and d[f] is not None else str(d[f])
                for f in fields
            ]
        )
    print(table(rows, ["tier", *fields]) + note)
    if stats.fingerprints:
        import datetime as dt

        print("\npipeline fingerprints (most recently used first):")
        for fp, info in stats.fingerprints.items():
            last = dt.datetime.fromtimestamp(info["last_used"]).strftime("%Y-%m-%d %H:%M")
            print(f"  {fp}  last used {last}  {info['keys_logged']} keys  {info['description']}")
    for report in reports:
        print(f"\n{report}")
    print(f"\n{book}" if book is not None else f"\nidentity ledger: refused: {refused}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from mmcache.maintenance import reclaim_memory

    cache = _open(args)
    try:
        report = cache.verify(repair=args.repair)
        note = _absent(cache)
        note += "".join(f"\n{t} tier: damaged: {why}" for t, why in report.damaged.items())
        note += "".join(
            f"\n{t} tier: damaged; salvaged {n['kept']} entries into a fresh file"
            f" ({n['lost']} unreadable entries lost)"
            for t, n in report.salvaged.items()
        )
        damaged = {**cache.degraded, **report.damaged}
        if args.repair and "memory" in damaged and reclaim_memory(cache):
            del damaged["memory"]  # removed: the next run makes a fresh one
            note += "\nmemory tier: damaged store removed (the next run makes a new one)"
    finally:
        cache.close()
    book, refused = _ledger(prune=False)
    if args.json:
        ident = book.as_dict() if book is not None else {"refused": refused}
        print_json({**report.as_dict(), "damaged": damaged, "identity_ledger": ident})
    else:
        where = " and ".join(report.tiers) or "no"
        print(
            f"checked {report.checked} entries in the {where} tier"
            f"{'s' if len(report.tiers) > 1 else ''}: {len(report.bad)} bad,"
            f" {report.removed} removed{note}"
        )
        for key, tier in list(zip(report.bad, report.bad_tiers, strict=True))[:20]:
            print(f"  bad entry {key} ({tier} tier)")
        print(book if book is not None else f"identity ledger: refused: {refused}")
    if damaged:
        return 1  # a tier that cannot be read was not checked (nor repaired, if in use)
    return 0 if report.ok or args.repair else 1


def _cmd_gc(args: argparse.Namespace) -> int:
    from mmcache.errors import ConfigError
    from mmcache.maintenance import sweep_orphans
    from mmcache.units import format_size

    if on_share(args, "gc", print_json):  # --shared URL: its old packs
        return 0
    if args.cache is None:
        root_only = ("older_than", "max_size", "unused_for", "compact")
        used = [f"--{n.replace('_', '-')}" for n in root_only if getattr(args, n)]
        if not args.all or used:
            needs = " ".join(used) if used else "gc"
            raise ConfigError(
                f"{needs} needs --cache ROOT (--all alone sweeps this node's orphaned "
                "shared-memory stores of every root)"
            )
        report = sweep_orphans()
        book, refused = _ledger(prune=True)
        if args.json:
            print_json({**report.as_dict(), "identity_ledger": _pruned_json(book, refused)})
        else:
            print(f"{len(report.orphan_segments)} orphaned shared-memory segments removed")
            print(f"{len(report.reject_logs)} reject logs of ended processes removed")
            print(
                f"{report.column_files} column files of manifests gone or changed and "
                f"{report.key_tables} key tables of them (or unused for 30 days) removed"
            )
            _print_pruned(book, refused)
        return 0 if refused is None else 1
    cache = _open(args)
    try:
        report = cache.gc(
            older_than=args.older_than,
            max_size=args.max_size,
            unused_for=args.unused_for,
            all_roots=args.all,
        )
        compacted = cache.compact() if args.compact else None
        # a damaged memory tier that is still there after the sweep is in use
        left = "" if report.orphan_segments or "memory" not in cache.degraded else _absent(cache)
    finally:
        cache.close()
    book, refused = _ledger(prune=True)
    if args.json:
        extra = {"compact": compacted.as_dict()} if compacted is not None else {}
        ident = {"identity_ledger": _pruned_json(book, refused)}
        print_json({**report.as_dict(), **extra, **ident})
    else:
        print(
            f"freed {format_size(report.freed_bytes)}: {report.expired} expired, "
            f"{report.corrupt} corrupt, {report.evicted} over budget, "
            f"{len(report.orphan_segments)} orphaned shared-memory segments, "
            f"{report.dropped_entries} entries of {len(report.dropped_fingerprints)} "
            f"unused pipeline fingerprints, {len(report.index_files)} stale WebDataset "
            f"member indexes, {len(report.reject_logs)} reject logs of ended processes, "
            f"{report.column_files} column files of manifests gone or changed and "
            f"{report.key_tables} key tables"
        )
        if compacted is not None:
            before, after = format_size(compacted.before), format_size(compacted.after)
            print(f"disk tier compacted: {before} -> {after}")
        if left:
            print(left.strip())
        _print_pruned(book, refused)
    return 0 if refused is None else 1


def _pruned_json(book: Any, refused: str | None) -> dict[str, Any]:
    return book.as_dict() if book is not None else {"refused": refused}


def _print_pruned(book: Any, refused: str | None) -> None:
    """What gc did to the identity ledger (a refusal on stderr: gc then exits 1)."""
    if book is None:
        print(f"mmcache gc: identity ledger not pruned: {refused}", file=sys.stderr)
        return
    if book.path is not None and book.exists:
        print(f"{book}: removed {book.gone} rows of files gone, {book.changed} of files changed")
    else:
        print(book)


# -- parser -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="mmcache",
        description="Decode, resize and tokenize image-text samples once; cache them.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument(
        "--version", action="version", version=_version(), help="print the version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    add_demo_parser(sub)

    p = sub.add_parser("synth", help="write a synthetic image-caption dataset")
    p.add_argument("out")
    p.add_argument("--n", type=int_at_least(1), default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--large", action="store_true", help="1,000-2,000 px sources")
    p.set_defaults(func=_cmd_synth)

    p = sub.add_parser("warm", help="fill a cache's disk tier ahead of training (resumable)")
    p.add_argument("manifest", help="a manifest, Parquet file/glob/folder, COCO json, HF dataset")
    add_data_options(p)
    p.add_argument("--cache", required=True, help="cache root")
    p.add_argument(
        "--disk",
        type=size_of("--disk"),
        help=f"disk budget (default: the root's recorded one; {WARM_DISK} for a new root)",
    )
    p.add_argument("--workers", type=int_at_least(0), default=os.cpu_count() or 1)
    p.add_argument("--features", help="module:factory returning a frozen encoder")
    add_pipeline_options(p)
    p.add_argument(
        "--policy", help="eviction policy (default: the root's recorded one; value for a new root)"
    )
    p.add_argument("--on-error", choices=["raise", "skip"], default="skip")
    add_warm_options(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_warm)

    add_bench_parser(sub)

    p = sub.add_parser("stats", help="per-tier items, bytes, budget, hits, misses, ...")
    p.add_argument("--cache", help="cache root (or --shared URL)")
    add_shared_options(p, "instead of --cache: count its packs, entries and bytes")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser(
        "verify", help="check every entry's header and checksum, in every tier that exists"
    )
    p.add_argument("--cache", required=True)
    p.add_argument(
        "--repair",
        action="store_true",
        help="remove bad entries (a damaged totals record of the disk tier is recounted)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser(
        "gc",
        help="remove expired, corrupt, orphaned and over-budget data; prune the identity ledger",
    )
    p.add_argument("--cache", help="cache root (not needed for --all alone)")
    p.add_argument("--older-than", type=duration, help="remove entries older than this (e.g. 7d)")
    p.add_argument(
        "--max-size",
        type=size_of("--max-size"),
        help="shrink the disk tier to this size (e.g. 10GiB)",
    )
    p.add_argument(
        "--unused-for",
        type=duration,
        help="drop entries of pipeline fingerprints unused this long (e.g. 30d)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="also remove orphaned shared-memory stores of this user's other cache roots"
        " (without --cache: of every root on this node, this user's and its groups')",
    )
    p.add_argument(
        "--compact",
        action="store_true",
        help="then give the disk tier's free pages back (only while no other process uses it)",
    )
    add_shared_options(
        p, "instead of --cache: remove its packs older than --older-than, and packs never committed"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_gc)

    add_inspect_parser(sub, _pipeline_for)
    return parser


def _version() -> str:
    """``mmcache 0.1.0 from /path/to/mmcache (python 3.12)``: which copy runs, as pip says
    it (a checkout on ``PYTHONPATH`` and an installed wheel can differ)."""
    import platform

    import mmcache

    where = os.path.dirname(os.path.abspath(mmcache.__file__))
    return f"mmcache {mmcache.__version__} from {where} (python {platform.python_version()})"


#: The exit status when the reader of stdout went away (``mmcache stats | head``): what a
#: shell reports for a command killed by SIGPIPE (128 + 13), as for ``yes | head``.
EXIT_BROKEN_PIPE = 128 + 13


def _stdout_gone() -> int:
    """After a BrokenPipeError on stdout: point stdout at /dev/null, so that the flush at
    exit writes nowhere instead of printing a second error (the recipe of the Python
    docs, "Note on SIGPIPE"), and give :data:`EXIT_BROKEN_PIPE`."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    # a stdout without a descriptor (an embedding caller's) has nothing to redirect
    with contextlib.suppress(OSError, ValueError):
        os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(glue_dash_values(parser, sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    from mmcache.errors import MmcacheError

    try:
        code: int = args.func(args)
        sys.stdout.flush()  # a reader that went away shows here, not at exit
    except BrokenPipeError:  # mmcache stats | head: the output was not wanted further
        return _stdout_gone()
    except MmcacheError as exc:
        print(f"mmcache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
