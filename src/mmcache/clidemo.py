"""``mmcache demo`` and ``mmcache bench``: the loader's epochs timed, on synthetic data
(``demo``, nothing to download) or on the user's own (``bench``, beside an uncached
``torch.utils.data.DataLoader`` epoch), each printed as one table of samples/s, hit
rate, the share served by each tier and the stall.

Kept apart from :mod:`mmcache.cli`, which registers them (:func:`add_demo_parser`,
:func:`add_bench_parser`): they run the library end to end, where the other commands
look after a cache root.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, cast

from mmcache.cliargs import (
    add_data_options,
    budget,
    data_options,
    fraction,
    int_at_least,
    parse_budget,
    print_json,
    size_of,
    table,
)
from mmcache.cliinspect import first_sample

__all__ = ["add_bench_parser", "add_demo_parser"]


def add_demo_parser(sub: Any) -> None:
    """Add ``demo`` to the CLI's subcommands (``sub``: argparse's subparsers)."""
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


def add_bench_parser(sub: Any) -> None:
    """Add ``bench`` to the CLI's subcommands (``sub``: argparse's subparsers)."""
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
        print(table(rows, header))
        if png is not None:
            plot(stats, png)
            print(f"plot written to {png}")
        if args.json:
            print_json(stats.as_dict())
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


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
        print_json(result)
    else:
        from mmcache.units import format_size

        disk = "off" if args.disk is None else format_size(args.disk)
        print(
            f"{len(ds)} samples, {format_size(data_bytes)} preprocessed; memory tier "
            f"{format_size(memory)}, disk tier {disk}, {args.workers} workers"
        )
        header = ["run", "samples/s", "vs uncached", "hit rate", "memory", "disk", "stall s"]
        print(table(rows, header))
    return 0
