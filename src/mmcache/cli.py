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
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from mmcache.cliargs import (
    Parser,
    add_data_options,
    add_pipeline_options,
    budget,
    data_options,
    duration,
    fraction,
    glue_dash_values,
    int_at_least,
    parse_budget,
    size_of,
)
from mmcache.cliinspect import add_inspect_parser, first_sample
from mmcache.clishared import add_shared_options, add_warm_options, on_share, shared_tier

__all__ = ["build_parser", "main"]

logger = logging.getLogger(__name__)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True, default=str))


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    lines = ["  ".join(str(h).rjust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


# -- demo ---------------------------------------------------------------------------------
def _cmd_demo(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    import mmcache as mc
    from mmcache.errors import ConfigError
    from mmcache.plot import plot, require_matplotlib
    from mmcache.units import format_size

    # The figure is the demo's last step and matplotlib an extra: a --plot that cannot be
    # honoured fails now, not after the epochs; without --plot the table is the result.
    try:
        require_matplotlib()
        png: Path | None = Path(args.plot) if args.plot else Path.cwd() / "mmcache-demo.png"
    except ConfigError as exc:
        if args.plot:
            raise
        print(f"no plot: {exc}")
        png = None
    torch.set_num_threads(1)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="mmcache-demo-"))
    keep = args.dir is not None
    try:
        t0 = time.perf_counter()
        print(f"making {args.n} synthetic image-caption pairs in {base / 'data'} ...")
        manifest = mc.synth.make_dataset(base / "data", args.n, seed=args.seed)
        captions = [json.loads(line)["caption"] for line in manifest.read_text().splitlines()]
        tokenizer = mc.train_tokenizer(captions, vocab_size=2048)
        pipe = mc.Pipeline(
            image=mc.ImageSpec(size=args.size), text=mc.TextSpec(tokenizer, max_length=32)
        )
        ds = mc.MultimodalDataset(manifest, pipeline=pipe)
        entry = mc.codec.encoded_size(ds.produce(0))
        data_bytes = entry * len(ds)
        memory = int(data_bytes * args.budget)
        print(
            f"dataset ready in {time.perf_counter() - t0:.1f}s: {len(ds)} samples, "
            f"{format_size(data_bytes)} preprocessed; memory tier {format_size(memory)} "
            f"({args.budget:.0%}), disk tier {format_size(2 * data_bytes)}"
        )
        cache = mc.Cache(
            base / "cache", memory=memory, disk=2 * data_bytes, policy=args.policy, temporary=True
        )
        loader = mc.DataLoader(
            ds,
            cache=cache,
            batch_size=args.batch_size,
            shuffle=True,
            seed=args.seed,
            num_workers=args.workers,
            persistent_workers=args.workers > 0,
        )
        try:
            for epoch in range(args.epochs):
                loader.set_epoch(epoch)
                for _ in tqdm(loader, desc=f"epoch {epoch}", unit="batch", leave=False):
                    pass
            stats = loader.stats()
        finally:
            del loader
            cache.close()
        rows = []
        for e in stats.epochs:
            rows.append(
                [
                    str(e.epoch),
                    f"{e.samples_per_s:,.0f}",
                    f"{e.hit_rate:.2f}",
                    f"{e.tier_hits.get('memory', 0) / max(e.samples, 1):.2f}",
                    f"{e.tier_hits.get('disk', 0) / max(e.samples, 1):.2f}",
                    str(e.misses),
                    f"{e.stall_s:.2f}",
                ]
            )
        header = ["epoch", "samples/s", "hit rate", "memory", "disk", "misses", "stall s"]
        print(_table(rows, header))
        if png is not None:
            plot(stats, png)
            print(f"plot written to {png}")
        if args.json:
            _print_json(stats.as_dict())
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


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
        _print_json(report.as_dict())
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
    from mmcache.sources.chat import read_text_reports
    from mmcache.units import format_size

    if on_share(args, "stats", _print_json):  # --shared URL: the share's counts
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
        _print_json({**out, "damaged": damaged, "identity_ledger": ident})
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
    print(_table(rows, ["tier", *fields]) + note)
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
        _print_json({**report.as_dict(), "damaged": damaged, "identity_ledger": ident})
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

    if on_share(args, "gc", _print_json):  # --shared URL: its old packs
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
            _print_json({**report.as_dict(), "identity_ledger": _pruned_json(book, refused)})
        else:
            print(f"{len(report.orphan_segments)} orphaned shared-memory segments removed")
            print(f"{len(report.reject_logs)} reject logs of ended processes removed")
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
        _print_json({**report.as_dict(), **extra, **ident})
    else:
        print(
            f"freed {format_size(report.freed_bytes)}: {report.expired} expired, "
            f"{report.corrupt} corrupt, {report.evicted} over budget, "
            f"{len(report.orphan_segments)} orphaned shared-memory segments, "
            f"{report.dropped_entries} entries of {len(report.dropped_fingerprints)} "
            f"unused pipeline fingerprints, {len(report.index_files)} stale WebDataset "
            f"member indexes, {len(report.reject_logs)} reject logs of ended processes"
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


# -- bench --------------------------------------------------------------------------------
def _cmd_bench(args: argparse.Namespace) -> int:
    import torch

    import mmcache as mc
    from mmcache.dataset import collate
    from mmcache.defaults import default_pipeline

    torch.set_num_threads(1)
    pipe = default_pipeline(size=args.size, max_length=args.max_length, tokenizer=args.tokenizer)
    ds = mc.open_source(args.manifest, pipeline=pipe, on_error="skip", **data_options(args))
    _, first, _ = first_sample(ds, limit=100)
    if first is None:
        raise mc.ConfigError(f"none of the first 100 samples of {args.manifest} can be decoded")
    data_bytes = mc.codec.encoded_size(first) * len(ds)
    memory = parse_budget(args.budget, data_bytes)
    rows: list[list[str]] = []
    result: dict[str, Any] = {"samples": len(ds), "data_bytes": data_bytes, "memory": memory}
    baseline = None
    if not args.no_baseline:
        # Every source open_source makes of a location is a torch Dataset (BaseSource).
        face = cast("torch.utils.data.Dataset[dict[str, Any] | None]", ds)
        plain: torch.utils.data.DataLoader[dict[str, Any] | None] = torch.utils.data.DataLoader(
            face,
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            collate_fn=collate,
        )
        t0 = time.perf_counter()
        n = sum(len(b.get("id", [])) for b in plain)
        baseline = n / (time.perf_counter() - t0)
        result["uncached_samples_per_s"] = baseline
        rows.append(["uncached", f"{baseline:,.0f}", "1.00", "-", "-", "-", "-"])
    root = Path(args.cache) if args.cache else Path(tempfile.mkdtemp(prefix="mmcache-bench-"))
    cache = mc.Cache(
        root, memory=memory, disk=args.disk, policy=args.policy, temporary=args.cache is None
    )
    try:
        with mc.DataLoader(
            ds,
            cache=cache,
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            persistent_workers=args.workers > 0,
        ) as loader:
            for epoch in range(args.epochs):
                loader.set_epoch(epoch)
                for _ in loader:
                    pass
            stats = loader.stats()
    finally:
        if args.cache is None:
            if cache.memory is not None:
                cache.memory.unlink()  # type: ignore[attr-defined]
            cache.close()
            shutil.rmtree(root, ignore_errors=True)
        else:
            cache.close()
    for e in stats.epochs:
        total = max(e.samples, 1)
        rows.append(
            [
                f"mmcache epoch {e.epoch}",
                f"{e.samples_per_s:,.0f}",
                f"{e.samples_per_s / baseline:.2f}" if baseline else "-",
                f"{e.hit_rate:.2f}",
                f"{e.tier_hits.get('memory', 0) / total:.2f}",
                f"{e.tier_hits.get('disk', 0) / total:.2f}",
                f"{e.stall_s:.2f}",
            ]
        )
    result["epochs"] = [e.as_dict() for e in stats.epochs]
    if args.json:
        _print_json(result)
    else:
        from mmcache.units import format_size

        disk = "off" if args.disk is None else format_size(args.disk)
        print(
            f"{len(ds)} samples, {format_size(data_bytes)} preprocessed; memory tier "
            f"{format_size(memory)}, disk tier {disk}, {args.workers} workers"
        )
        header = ["run", "samples/s", "vs uncached", "hit rate", "memory", "disk", "stall s"]
        print(_table(rows, header))
    return 0


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

    p = sub.add_parser("demo", help="run the main job on synthetic data (nothing to download)")
    p.add_argument("--dir", help="keep the data and cache here (default: a temporary folder)")
    p.add_argument("--n", type=int_at_least(1), default=2000, help="samples (default 2000)")
    p.add_argument("--epochs", type=int_at_least(1), default=3)
    p.add_argument("--workers", type=int_at_least(0), default=2)
    p.add_argument("--batch-size", type=int_at_least(1), default=64)
    p.add_argument(
        "--size", type=int_at_least(1), default=224, help="image side in px (default 224)"
    )
    p.add_argument(
        "--budget",
        type=fraction,
        default=0.5,
        help="memory tier as a fraction of the preprocessed data (default 0.5)",
    )
    p.add_argument("--policy", default="value")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--plot", help="PNG path (default ./mmcache-demo.png; needs the mmcache[plot] extra)"
    )
    p.add_argument("--json", action="store_true", help="also print the stats as JSON")
    p.set_defaults(func=_cmd_demo)

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

    p = sub.add_parser("bench", help="the loader benchmark on your own data")
    p.add_argument("manifest", help="a manifest, Parquet file/glob/folder, COCO json, HF dataset")
    add_data_options(p)
    p.add_argument(
        "--budget", type=budget, default="50%", help="memory tier: 50%% of the data, or 2GiB"
    )
    p.add_argument("--epochs", type=int_at_least(1), default=3)
    p.add_argument("--workers", type=int_at_least(0), default=2)
    p.add_argument("--batch-size", type=int_at_least(1), default=64)
    p.add_argument(
        "--disk", type=size_of("--disk"), help="also a disk tier of this size (e.g. 10GiB)"
    )
    p.add_argument("--cache", help="cache root to use and keep (default: a temporary one)")
    p.add_argument("--policy", default="value")
    p.add_argument("--size", type=int_at_least(1), default=224)
    p.add_argument("--max-length", type=int_at_least(1), default=32)
    p.add_argument("--tokenizer", help="tokenizer.json (default: the built-in offline one)")
    p.add_argument("--no-baseline", action="store_true", help="skip the uncached epoch")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_bench)

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
