"""Sources benchmark (issue 16): the same samples as loose files + JSONL, as WebDataset
shards, and as shards on a local S3 server behind a 25 ms proxy, side by side.

One run, the same COCO-sized synthetic samples (``mmcache.synth.make_dataset``), the
same preprocessing (resize 256, crop 224, 32 tokens), batch size, workers and seed:

- ``files``: ``MultimodalDataset`` over the JSONL manifest and the loose JPEGs;
- ``wds``: ``WebDatasetSource`` over the same samples written as tar shards;
- ``wds-s3-25ms``: the same shards uploaded to moto's S3 server (a separate process on
  127.0.0.1) read through ``s3://`` behind a TCP proxy adding ``--latency`` (25 ms) to
  every request, with a raw-bytes tier and ``RemotePrefetch`` (16 threads, one ranged
  GET per 8 MiB block of a shard); ``wds-s3-25ms-1get``, the same with one GET per
  sample (``fetch_block=None``, what the source did before); and ``wds-s3-0ms``, the
  same through the proxy without delay: the ratio of the two says how much of the
  latency the prefetch hides, whatever moto's own cost per request. The S3 rows also
  give the GETs of shards in the cold epoch, the requests of a warm epoch (the
  revalidation) and the time the revalidation took, counted at the proxy;
- ``parquet``: left for the Parquet source (issue 16, tabular part): filled in when
  ``mmcache.sources.parquet`` exists in the tree this runs from;
- ``webdataset``: the webdataset library (1.0.2) reading the same shards in place with
  the same preprocessing (no cache: every epoch is a cold one).

Bad weather (issue 27), the same shards behind a
:class:`support.faults.FaultProxy` at ``--latency``, default retry policy:

- ``server down, warm epoch``: after a cold and a warm epoch the proxy refuses every
  connection; the next three epochs (the first pays the tries that open the circuit
  breaker, the others one refused probe), in seconds, against a warm ``wds`` epoch;
- ``restart during outage``: a new source opened on the same index folder and raw tier
  while the store is down (``offline="auto"``: from the kept listing), its open time,
  and one epoch from the raw tier (no cache: every sample decoded), samples served;
- ``1% errors, cold epoch``: a cold epoch (empty raw tier and cache, one GET per
  sample so that 1% is more than a handful) while 1% of the requests are answered 503,
  against the clean cold epoch of ``wds-s3-<latency>``;
  the batches are compared with the local ones (bitwise).

Each mmcache row: a cold epoch (empty cache root and raw tier; shard indexes already
built, as on any run after the first) and warm epochs (everything in the memory tier;
median of ``--warm`` epochs taken in turns, one of each row after another), in
samples/s, and the ratios the issue asks for.
Nothing here is a pass/fail time.

    .venv/bin/python benchmarks/sources.py              # 3,000 samples, ~3 min on 2 cores
    .venv/bin/python benchmarks/sources.py --quick      # 300 samples
    .venv/bin/python benchmarks/sources.py --compare REF [--rounds 4] [--n 600]

``--compare REF``: the warm ratios only, this tree and commit REF in turns
(``benchmarks/treecompare.py``, as ``benchmarks/loader.py --compare``): each round a fresh
process per tree over the same generated samples opens ``files``, ``wds`` and
``wds-s3-0ms`` (moto in its own process, the proxy without delay, raw tier and
``RemotePrefetch``), takes a cold epoch of each, then ``--pairs`` times a numpy-gather bound
epoch (the loader benchmark's: every preprocessed sample in memory) followed by a warm
epoch of each source; a source's figure is the median of its warm rate / the bound's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import mmcache as mc
from mmcache.cache import Cache
from mmcache.sources.blobs import RawTier
from mmcache.sources.blobs.prefetch import RemotePrefetch
from mmcache.sources.bytesproc import process_bytes
from mmcache.sources.wds import WebDatasetSource, write_shards
from treecompare import compare_trees  # benchmarks/ (the script's folder is on sys.path)

# The local S3 server's credentials and the proxies are the tests' (tests/support/), not
# the package's: this checkout's tests/ goes on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.faults import FaultProxy
from support.s3 import KEY, REGION, SECRET, DelayProxy, moto_process, s3_client

torch.set_num_threads(1)


def epoch_rate(loader: Any) -> float:
    t0 = time.perf_counter()
    n = sum(len(b["id"]) for b in loader)
    return n / (time.perf_counter() - t0)


class Run:
    """One mmcache row: its loader and cache, kept open so that warm epochs of every row
    can be taken in turns (the same machine noise for all)."""

    def __init__(
        self,
        name: str,
        make: Callable[[Path], tuple[Any, list[Any]]],
        tmp: Path,
        args: argparse.Namespace,
        proxy: DelayProxy | None = None,
    ) -> None:
        self.name = name
        self.proxy = proxy
        src, hooks = make(tmp / f"raw-{name}")
        self.hooks = hooks
        self.cache = Cache(tmp / f"cache-{name}", memory="2GiB", disk=None, temporary=True)
        self.loader = mc.DataLoader(
            src,
            cache=self.cache,
            batch_size=args.batch,
            num_workers=args.workers,
            persistent_workers=True,
            seed=0,
            hooks=hooks,
        )
        before = self._requests()
        self.cold = epoch_rate(self.loader)
        self.cold_gets = self._requests()[0] - before[0]
        self.warm: list[float] = []
        self.warm_requests: list[int] = []
        self.revalidate_s: list[float] = []

    def _requests(self) -> tuple[int, int]:
        """Object GETs and all requests the proxy forwarded so far."""
        if self.proxy is None:
            return 0, 0
        return len(self.proxy.object_gets("/data/wds/")), len(self.proxy.requests)

    def warm_epoch(self) -> None:
        before = self._requests()
        self.warm.append(epoch_rate(self.loader))
        self.warm_requests.append(self._requests()[1] - before[1])
        for hook in self.hooks:
            self.revalidate_s.append(getattr(hook, "revalidate_s", 0.0))

    def row(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "cold": self.cold,
            "warm": statistics.median(self.warm),
            "warm_best": max(self.warm),
            "warm_all": self.warm,
        }
        if self.proxy is not None:
            out["cold_gets"] = self.cold_gets
            out["warm_requests"] = max(self.warm_requests)
            out["revalidate_ms"] = 1e3 * statistics.median(self.revalidate_s or [0.0])
        return out

    def close(self) -> None:
        self.loader.close()
        self.cache.close()


def run_webdataset(shards: list[Path], pipe: mc.Pipeline, args: argparse.Namespace) -> Any:
    try:
        import webdataset as wds
    except ImportError as exc:
        return {"name": "webdataset", "error": str(exc)}

    def prep(sample: dict[str, Any]) -> dict[str, Any]:
        text = sample["txt"].decode("utf-8")
        out = process_bytes(pipe, sample["jpg"], text, sample_id=sample["__key__"], path=None)
        return {k: torch.from_numpy(v) for k, v in out.items()}

    urls = [str(p) for p in shards]
    ds = (
        wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False)
        .shuffle(1000)
        .map(prep)
        .batched(args.batch, partial=True)
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.workers)
    rates = []
    for _ in range(2):
        t0 = time.perf_counter()
        n = sum(len(b["image"]) for b in loader)
        rates.append(n / (time.perf_counter() - t0))
    return {"name": "webdataset", "cold": rates[0], "warm": rates[1], "warm_all": rates[1:]}


def bad_weather(
    *,
    urls: list[str],
    shards: list[Path],
    pipe: mc.Pipeline,
    index: Path,
    tmp: Path,
    args: argparse.Namespace,
    port: int,
    local_warm_s: float,
    clean_cold: float,
) -> dict[str, str]:
    """The three bad-weather rows (see the module docstring), as ``case -> figure``."""
    out: dict[str, str] = {}
    with FaultProxy("127.0.0.1", port, latency=args.latency) as proxy:
        options = _s3_options(proxy.url)

        def source(raw: Path, **kw: Any) -> WebDatasetSource:
            return WebDatasetSource(
                urls,
                pipeline=pipe,
                index_dir=index,
                storage_options=options,
                raw=RawTier(raw, budget="4GiB"),
                on_error="skip",
                **kw,
            )

        src = source(tmp / "raw-weather")
        cache = Cache(tmp / "cache-weather", memory="2GiB", disk=None, temporary=True)
        loader = mc.DataLoader(
            src,
            cache=cache,
            batch_size=args.batch,
            num_workers=args.workers,
            persistent_workers=True,
            seed=0,
            hooks=[RemotePrefetch(src, threads=16)],
        )
        epoch_rate(loader)
        warm_s = args.n / epoch_rate(loader)
        proxy.mode = "refuse"
        down = [args.n / epoch_rate(loader) for _ in range(3)]
        served = len(src) - len(src.rejects())
        out["server down, warm epoch"] = (
            f"{down[0]:.2f} s, then {down[1]:.2f} s and {down[2]:.2f} s (warm S3 epoch before "
            f"{warm_s:.2f} s; warm local wds {local_warm_s:.2f} s: {down[0] / local_warm_s:.1f}x "
            f"then {max(down[1:]) / local_warm_s:.1f}x); {served} of {len(src)} served"
        )
        loader.close()
        cache.close()
        t0 = time.perf_counter()
        again = source(tmp / "raw-weather")  # the store is still down
        opened = time.perf_counter() - t0
        t0 = time.perf_counter()
        n = sum(len(b["id"]) for b in mc.DataLoader(again, cache=None, batch_size=args.batch))
        epoch = time.perf_counter() - t0
        out["restart during outage"] = (
            f"opened in {opened:.2f} s from the kept listing; epoch from the raw tier "
            f"{n / epoch:.0f} samples/s, {n} of {len(again)} served, "
            f"{len(again.rejects())} rejected"
        )
        proxy.mode = "up"
        proxy.error_rate = 0.01
        flaky = source(tmp / "raw-errors", fetch_block=None)  # a GET per sample: 1% of many
        cache = Cache(tmp / "cache-errors", memory="2GiB", disk=None, temporary=True)
        loader = mc.DataLoader(
            flaky,
            cache=cache,
            batch_size=args.batch,
            num_workers=args.workers,
            persistent_workers=True,
            seed=0,
            hooks=[RemotePrefetch(flaky, threads=16)],
        )
        before = len(proxy.requests), proxy.injected
        t0 = time.perf_counter()
        got = list(loader)
        cold = args.n / (time.perf_counter() - t0)
        local = WebDatasetSource(shards, pipeline=pipe, index_dir=index)
        want = mc.DataLoader(local, cache=None, batch_size=args.batch, seed=0)
        same = all(
            a["id"] == b["id"] and bool((a["image"] == b["image"]).all())
            for a, b in zip(got, want, strict=True)
        )
        out["1% errors, cold epoch"] = (
            f"{cold:.0f} samples/s ({cold / clean_cold:.2f}x the clean cold S3 epoch); "
            f"{proxy.injected - before[1]} of "
            f"{len(proxy.requests) - before[0]} requests answered 503; "
            f"{len(flaky.rejects())} rejected; batches bitwise the local ones: {same}"
        )
        loader.close()
        cache.close()
    return out


def _s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": KEY,
        "secret": SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": REGION},
    }


def _upload(url: str, shards: list[Path]) -> list[str]:
    """Upload ``shards`` to the moto server at ``url``; their ``s3://`` URLs."""
    client = s3_client(url)
    for p in shards:
        client.upload_file(str(p), "data", f"wds/{p.name}")
    return [f"s3://data/wds/{p.name}" for p in shards]


def warm_ratios(data: Path, args: argparse.Namespace) -> dict[str, float]:
    """What ``--compare`` measures per tree (see the module docstring): each source's median
    warm rate / the bound's, epochs taken in turns. ``data``: the samples and shards,
    generated there by the first run (seeded) and reused by the others."""
    from loader import numpy_arrays, numpy_epoch  # the loader benchmark's bound

    manifest = data / "data" / "manifest.jsonl"
    if not manifest.exists():
        manifest = Path(mc.synth.make_dataset(data / "data", args.n, seed=0))
    shards = sorted((data / "shards").glob("*.tar"))
    if not shards:
        shards = write_shards(manifest, data / "shards", per_shard=args.per_shard)
    tok = mc.train_tokenizer(mc.synth.synth_captions(2000), vocab_size=2048)
    pipe = mc.Pipeline(
        image=mc.ImageSpec(size=224, resize=256), text=mc.TextSpec(tok, max_length=32)
    )
    with (
        tempfile.TemporaryDirectory(prefix="mmcache-sources-ratio-") as d,
        contextlib.ExitStack() as stack,
    ):
        tmp = Path(d)
        index = tmp / "wds-index"
        files_ds = mc.MultimodalDataset(manifest, pipeline=pipe)
        url = stack.enter_context(moto_process())
        urls = _upload(url, shards)
        proxy = stack.enter_context(DelayProxy("127.0.0.1", int(url.rsplit(":", 1)[1]), delay=0.0))

        def files(_: Path) -> tuple[Any, list[Any]]:
            return files_ds, []

        def local(_: Path) -> tuple[Any, list[Any]]:
            return WebDatasetSource(shards, pipeline=pipe, index_dir=index), []

        def remote(raw_dir: Path) -> tuple[Any, list[Any]]:
            src = WebDatasetSource(
                urls,
                pipeline=pipe,
                index_dir=index,
                storage_options=_s3_options(proxy.url),
                raw=RawTier(raw_dir, budget="4GiB"),
                fetch_block="8MiB",
            )
            return src, [RemotePrefetch(src, threads=16)]

        runs = [Run("files", files, tmp, args), Run("wds", local, tmp, args)]
        runs.append(Run("wds-s3-0ms", remote, tmp, args, proxy))
        arrays = numpy_arrays(files_ds)
        n, rng = len(files_ds), np.random.default_rng(1)
        ratios: dict[str, list[float]] = {run.name: [] for run in runs}
        for _ in range(args.pairs):
            t0 = time.perf_counter()
            numpy_epoch(arrays, rng.permutation(n), args.batch)
            bound = n / (time.perf_counter() - t0)
            for run in runs:
                run.warm_epoch()
                ratios[run.name].append(run.warm[-1] / bound)
        for run in runs:
            run.close()
    return {name: statistics.median(values) for name, values in ratios.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=3000)
    # 200 COCO-sized samples are ~14 MiB: moto serves ranged GETs of objects over ~16 MiB
    # several times slower (it reads the whole object per request), real stores do not.
    ap.add_argument("--per-shard", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--warm", type=int, default=7)
    ap.add_argument("--latency", type=float, default=0.025)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--no-per-sample",
        dest="per_sample",
        action="store_false",
        help="leave out the S3 row with one GET per sample (fetch_block=None)",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--compare", metavar="REF", help="warm ratios, this tree and REF in turns")
    ap.add_argument("--rounds", type=int, default=4, help="--compare: rounds per tree")
    ap.add_argument("--pairs", type=int, default=5, help="--compare: bound+warm epochs per round")
    ap.add_argument("--warm-ratios", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.n, args.per_shard, args.warm = 300, 100, 2
    if args.warm_ratios:
        print(json.dumps(warm_ratios(args.data, args)))
        return
    if args.compare:
        argv = ["--warm-ratios", "--n", str(args.n), "--per-shard", str(args.per_shard)]
        argv += ["--batch", str(args.batch), "--workers", str(args.workers)]
        compare_trees(
            args.compare,
            script=Path(__file__).resolve(),
            argv=[*argv, "--pairs", str(args.pairs)],
            rounds=args.rounds,
            figures={name: f"{name} warm/bound" for name in ("files", "wds", "wds-s3-0ms")},
        )
        return

    with tempfile.TemporaryDirectory(prefix="mmcache-sources-") as d:
        tmp = Path(d)
        manifest = mc.synth.make_dataset(tmp / "data", args.n, seed=0)
        shards = write_shards(manifest, tmp / "shards", per_shard=args.per_shard)
        tok = mc.train_tokenizer(mc.synth.synth_captions(2000), vocab_size=2048)
        pipe = mc.Pipeline(
            image=mc.ImageSpec(size=224, resize=256), text=mc.TextSpec(tok, max_length=32)
        )
        index = tmp / "wds-index"
        rows: list[dict[str, Any]] = []

        def files(_: Path) -> tuple[Any, list[Any]]:
            return mc.MultimodalDataset(manifest, pipeline=pipe), []

        def local(_: Path) -> tuple[Any, list[Any]]:
            return WebDatasetSource(shards, pipeline=pipe, index_dir=index), []

        runs = [Run("files", files, tmp, args)]
        WebDatasetSource(shards, pipeline=pipe, index_dir=index)  # the indexes, once
        runs.append(Run("wds", local, tmp, args))
        try:
            from mmcache.sources import parquet  # noqa: F401  (the tabular part of issue 16)
        except ImportError:
            rows.append({"name": "parquet", "error": "mmcache.sources.parquet not in this tree"})
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(moto_process())
            urls = _upload(url, shards)
            port = int(url.rsplit(":", 1)[1])
            for latency in (0.0, args.latency):
                proxy = stack.enter_context(DelayProxy("127.0.0.1", port, delay=latency))
                options = _s3_options(proxy.url)

                def remote(
                    raw_dir: Path, options: Any = options, block: Any = "8MiB"
                ) -> tuple[Any, list[Any]]:
                    src = WebDatasetSource(
                        urls,
                        pipeline=pipe,
                        index_dir=index,
                        storage_options=options,
                        raw=RawTier(raw_dir, budget="4GiB"),
                        fetch_block=block,
                    )
                    return src, [RemotePrefetch(src, threads=16)]

                def per_sample(raw_dir: Path, options: Any = options) -> tuple[Any, list[Any]]:
                    return remote(raw_dir, options, None)

                if latency == 0.0:
                    remote(tmp / "raw-index-warmup")  # the indexes, once
                name = f"wds-s3-{latency * 1e3:.0f}ms"
                runs.append(Run(name, remote, tmp, args, proxy))
                if latency and args.per_sample:  # as before: one GET per sample
                    runs.append(Run(f"{name}-1get", per_sample, tmp, args, proxy))
            for _ in range(args.warm):  # warm epochs in turns
                for run in runs:
                    run.warm_epoch()
            rows = [run.row() for run in runs] + rows
            local_warm_s = args.n / max(runs[1].warm)
            ms = f"{args.latency * 1e3:.0f}"  # the best warm wds epoch, seconds
            for run in runs:
                run.close()
            clean = next((r["cold"] for r in rows if r["name"] == f"wds-s3-{ms}ms"), float("nan"))
            weather = bad_weather(
                urls=urls,
                shards=shards,
                pipe=pipe,
                index=index,
                tmp=tmp,
                args=args,
                port=port,
                local_warm_s=local_warm_s,
                clean_cold=clean,
            )
        rows.append(run_webdataset(shards, pipe, args))

    by = {r["name"]: r for r in rows if "cold" in r}
    ratios = {}
    if {"files", "wds"} <= by.keys():
        ratios["cold wds / files (target >= 0.95)"] = by["wds"]["cold"] / by["files"]["cold"]
        ratios["warm wds / files (target 0.9-1.1)"] = by["wds"]["warm"] / by["files"]["warm"]
    s3 = f"wds-s3-{args.latency * 1e3:.0f}ms"
    if {"wds", s3, "wds-s3-0ms"} <= by.keys():
        ratios[f"cold {s3} / wds (target >= 0.8)"] = by[s3]["cold"] / by["wds"]["cold"]
        ratios[f"cold {s3} / wds-s3-0ms (latency hidden: ~1)"] = (
            by[s3]["cold"] / by["wds-s3-0ms"]["cold"]
        )
        ratios[f"warm {s3} / wds (target 0.9-1.1)"] = by[s3]["warm"] / by["wds"]["warm"]
        ratios[f"warm {s3} / wds, best epochs"] = by[s3]["warm_best"] / by["wds"]["warm_best"]
        ratios["warm wds-s3-0ms / wds, best epochs"] = (
            by["wds-s3-0ms"]["warm_best"] / by["wds"]["warm_best"]
        )
    if {"wds", f"{s3}-1get"} <= by.keys():
        ratios[f"cold {s3}-1get / wds (one GET per sample, as before)"] = (
            by[f"{s3}-1get"]["cold"] / by["wds"]["cold"]
        )
    load = os.getloadavg()
    lines = [
        f"load average at the end: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}",
        f"n={args.n}, per shard={args.per_shard}, batch={args.batch}, workers={args.workers}",
        "",
        "| source | cold epoch (samples/s) | warm epoch, median (samples/s) | warm, best | "
        "GETs of shards, cold epoch | requests, warm epoch | revalidation (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "cold" in r:
            extra = (
                f"{r['cold_gets']} | {r['warm_requests']} | {r['revalidate_ms']:.0f}"
                if "cold_gets" in r
                else "- | - | -"
            )
            best = r.get("warm_best", r["warm"])
            lines.append(
                f"| {r['name']} | {r['cold']:.0f} | {r['warm']:.0f} | {best:.0f} | {extra} |"
            )
        else:
            lines.append(f"| {r['name']} | - | - ({r['error']}) | - | - | - | - |")
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in ratios.items()]
    lines += ["", "| bad weather | figure |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in weather.items()]
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sources-latest.md").write_text(text + "\n")
    (args.out / "sources-latest.json").write_text(
        json.dumps(
            {
                "rows": rows,
                "ratios": ratios,
                "weather": weather,
                "args": vars(args) | {"out": str(args.out)},
            }
        )
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
