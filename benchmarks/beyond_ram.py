"""Data larger than memory (issue 17): the disk tier's warm epochs, side by side in one run.

Rows, on COCO-sized synthetic data (``mmcache.synth``: 480-640 px JPEGs, 224 px
samples, 32 tokens), 2 workers, batch 64:

* (a) ``torch-uncached``: a plain torch DataLoader decoding every epoch;
* (b) ``memory-100%``: the memory tier holds everything (today's warm path);
* (c) ``disk-only (page cache warm)``: no memory tier, the disk tier holds all;
* (d) ``disk-only (page cache dropped)``: (c) with ``posix_fadvise(DONTNEED)`` on the
  cache files before each warm epoch; beside it the device's sequential read
  bandwidth of the same file, measured by ``dd`` after dropping its pages;
* (e) ``memory-25% + disk-100%``;
* peers from ``benchmarks/peers`` (HF Arrow, LitData) when they can run here.

Per row: cold (first) epoch and warm epochs samples/s, peak PSS of the loader's
processes (the training process and its workers, ``psutil``), and the page cache the
cache files occupy after the row (``mincore``).

    PYTHONPATH=src python benchmarks/beyond_ram.py --n 3000      # the README table
    PYTHONPATH=src python benchmarks/beyond_ram.py --n 300 --quick
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))

import bench  # noqa: E402  (benchmarks/peers: the data and the peers' harness)

from mmcache import codec  # noqa: E402
from mmcache.cache import Cache  # noqa: E402
from mmcache.codec.compact import parse_disk_form  # noqa: E402
from mmcache.dataset import MultimodalDataset  # noqa: E402
from mmcache.loader import DataLoader  # noqa: E402
from mmcache.loader.batchlayout import byte_ranges  # noqa: E402
from mmcache.stores.disk.formed import FormedDiskStore  # noqa: E402
from mmcache.transforms import ImageSpec, TextSpec  # noqa: E402
from mmcache.transforms.pipeline import Pipeline  # noqa: E402

_libc = ctypes.CDLL(None, use_errno=True)


def resident_bytes(path: Path) -> int:
    """Bytes of ``path`` in the page cache now (``mincore`` over a fresh mapping)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        rc = _libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        del view
    if rc != 0:
        return -1
    return int(np.frombuffer(vec, np.uint8).astype(bool).sum()) * mmap.PAGESIZE


def unmap_pages(path: Path) -> None:
    """``madvise(MADV_DONTNEED)`` on this process's mappings of ``path``: the page cache
    keeps a page some process maps, so ``posix_fadvise(DONTNEED)`` alone would not drop
    what LMDB's map touched (the pages come back from the page cache or the device on
    the next access: nothing is lost)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        lines = [ln for ln in f if ln.rstrip().endswith(real)]
    for ln in lines:
        lo, hi = (int(x, 16) for x in ln.split()[0].split("-"))
        _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


def drop_pages(folder: Path) -> None:
    """Drop the page cache of every file under ``folder`` (no root needed): this
    process's mappings first (:func:`unmap_pages`), then ``posix_fadvise(DONTNEED)``."""
    for p in folder.rglob("*"):
        if p.is_file():
            unmap_pages(p)
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd) if os.access(p, os.W_OK) else None
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dd_bandwidth(path: Path) -> float:
    """The device's sequential read bandwidth (bytes/s) of ``path``, its pages dropped."""
    drop_pages(path.parent)
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M"], check=True, capture_output=True)
    return path.stat().st_size / (time.perf_counter() - t0)


def mm_row(
    name: str,
    ds: MultimodalDataset,
    root: Path,
    args: argparse.Namespace,
    *,
    memory: int,
    disk: int | None,
    drop: bool = False,
    uncached: bool = False,
    form: str = "raw",
    via_workers: bool = False,
) -> dict[str, Any]:
    monitor = bench.Monitor(os.getpid(), bench._shm_names())
    monitor.phase = name
    monitor.start()
    shutil.rmtree(root, ignore_errors=True)
    cache = (
        None if uncached else Cache(root, memory=memory, disk=disk, temporary=True, disk_form=form)
    )
    if via_workers and cache is not None and cache.disk is not None:
        cache.disk.supports_gather = False  # hits looked up and unpacked by the workers
    epochs: list[tuple[float, int, dict[str, int]]] = []
    left: list[int] = []  # (d): the cache file's resident bytes after each drop
    try:
        loader = DataLoader(
            ds, cache=cache, batch_size=args.batch_size, num_workers=args.workers, seed=0
        )
        e = 0
        while e < args.epochs or (
            not uncached and e < args.max_epochs and sum(t for t, _, _ in epochs[1:]) < 2.0
        ):
            if drop and e > 0 and cache is not None:
                drop_pages(root / "disk")
                left.append(resident_bytes(root / "disk" / "data.mdb"))
            loader.set_epoch(e)
            t0 = time.perf_counter()
            n = sum(len(b["id"]) for b in loader)
            epochs.append((time.perf_counter() - t0, n, {}))
            e += 1
            if uncached and e >= 2:
                break
        tiers = [dict(s.tier_hits) for s in loader.stats().epochs]
        folder = "disk" if form == "raw" else f"disk-{parse_disk_form(form).tag}"
        files = root / folder / "data.mdb"
        resident = resident_bytes(files) if files.exists() else 0
        stored = cache.disk.nbytes() if cache is not None and cache.disk is not None else 0
        unpack_us, gather_us, psnr = 0.0, 0.0, float("inf")
        if form != "raw" and cache is not None and cache.disk is not None:
            disk = cache.disk
            assert isinstance(disk, FormedDiskStore)
            keys = [ds.key(i) for i in range(min(50, len(ds)))]
            packed = [disk.form.pack(codec.encode(ds.produce(i))) for i in range(len(keys))]
            t0 = time.perf_counter()
            back = [disk.form.unpack(p) for p in packed]
            unpack_us = (time.perf_counter() - t0) / len(packed) * 1e6
            segments = byte_ranges(codec.read_header(back[0])).segments
            targets = [(a, b - a, np.empty((1, b - a), dtype=np.uint8)) for a, b, _ in segments]
            t0 = time.perf_counter()
            for p in packed:  # what the in-process gather does per entry, on one thread
                codec.checksum_matches(p)
                disk.form.write_ranges(p, targets, 0)  # type: ignore[attr-defined]
            gather_us = (time.perf_counter() - t0) / len(packed) * 1e6
            err = [
                np.mean((codec.decode(b)["image"].astype(float) - ds.produce(i)["image"]) ** 2)
                for i, b in enumerate(back)
            ]
            psnr = float(10 * np.log10(255.0**2 / max(float(np.mean(err)), 1e-12)))
    finally:
        if cache is not None:
            if cache.memory is not None:
                cache.memory.unlink()  # type: ignore[attr-defined]
            cache.close()
        monitor.stop_event.set()
        monitor.join()
    cold = epochs[0][1] / epochs[0][0]
    warm = sum(n for _, n, _ in epochs[1:]) / sum(t for t, _, _ in epochs[1:])
    return {
        "row": name,
        "cold": cold,
        "warm": warm,
        "epochs": len(epochs),
        "pss": monitor.peak_pss.get(name, 0),
        "page_cache": resident,
        "tier_hits_last": tiers[-1] if tiers else {},
        "disk_bytes_per_sample": stored / max(len(ds), 1),
        "unpack_us": unpack_us,
        "gather_us": gather_us,
        "psnr_db": psnr,
        "resident_after_drop": left,
    }


def peer_row(
    system: str, data: dict[str, Any], args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    ns = argparse.Namespace(
        epochs=args.epochs,
        workers=args.workers,
        batch_size=args.batch_size,
        seed=0,
        min_warm_s=2.0,
        max_epochs=args.max_epochs,
        timeout=900,
    )
    r = bench.run_system(system, "coco", data, ns, work)
    if r.get("status") != "ok":
        return {"row": system, "status": r.get("status"), "reason": r.get("reason", "")[:120]}
    eps = r["epochs"]
    warm_s = sum(e["s"] for e in eps[1:])
    return {
        "row": system,
        "cold": eps[0]["samples"] / eps[0]["s"],
        "warm": sum(e["samples"] for e in eps[1:]) / warm_s if warm_s else float("nan"),
        "epochs": len(eps),
        "pss": max((r.get("peak_pss_bytes") or {}).values(), default=0),
        "page_cache": None,
    }


def _psnr_text(db: float) -> str:
    return "lossless" if db > 100 else f"{db:.1f} dB"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=3000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-epochs", type=int, default=8)
    p.add_argument("--data-dir", default=str(Path(tempfile.gettempdir()) / "mmcache-beyond-data"))
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "mmcache-beyond-work"))
    p.add_argument("--skip-peers", action="store_true")
    p.add_argument("--quick", action="store_true", help="2 epochs")
    p.add_argument("--json", default="")
    p.add_argument(
        "--rows", default="abcdef", help="the rows to run, by letter (a and b always run)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.max_epochs = 2, 3
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = bench.prepare_data(Path(args.data_dir), {"coco": args.n}, 0, 8000)["coco"]
    pipe = Pipeline(
        image=ImageSpec(size=224, resize=256), text=TextSpec(data["tokenizer"], max_length=32)
    )
    ds = MultimodalDataset(data["manifest"], pipeline=pipe)
    entry = int(data["sample_bytes"]) + 512
    full = entry * args.n + (8 << 20)
    rows: list[dict[str, Any]] = []
    root = work / "cache"
    rows.append(mm_row("(a) torch-uncached", ds, root, args, memory=0, disk=None, uncached=True))
    rows.append(mm_row("(b) memory-100%", ds, root, args, memory=full, disk=None))
    want = set(args.rows) | {"a", "b"}
    if "c" in want:
        rows.append(mm_row("(c) disk-only, page cache warm", ds, root, args, memory=0, disk=full))
    if "d" in want:
        rows.append(
            mm_row(
                "(d) disk-only, page cache dropped", ds, root, args, memory=0, disk=full, drop=True
            )
        )
    # The device's bandwidth, on a file of the cache's size written just now.
    probe = work / "dd-probe.bin"
    with open(probe, "wb") as f:
        chunk = os.urandom(4 << 20)
        for _ in range(max(1, full // len(chunk))):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    bw_before = dd_bandwidth(probe)
    probe.unlink()
    if "e" in want:
        rows.append(
            mm_row(
                "(e) memory-25% + disk-100%", ds, root, args, memory=entry * args.n // 4, disk=full
            )
        )
    for form in ("zstd", "jpeg:90") if "f" in want else ():
        rows.append(
            mm_row(
                f"(f) disk-only, disk_form={form}", ds, root, args, memory=0, disk=full, form=form
            )
        )
        rows.append(  # side by side: the same tier with its hits unpacked by the workers
            mm_row(
                f"(f') disk_form={form}, hits via the workers",
                ds,
                root,
                args,
                memory=0,
                disk=full,
                form=form,
                via_workers=True,
            )
        )
    if not args.skip_peers:
        for system in ("hf-datasets-arrow", "litdata"):
            with contextlib.suppress(Exception):
                rows.append(peer_row(system, data, args, work))
    b = next(r["warm"] for r in rows if r["row"].startswith("(b)"))
    a = next(r["warm"] for r in rows if r["row"].startswith("(a)"))
    entry_mb = entry * args.n / 1e6
    print(
        f"\n{args.n} samples ({entry_mb:.0f} MB cached), {args.workers} workers, "
        f"batch {args.batch_size}; dd sequential read: {bw_before / 1e6:.0f} MB/s"
    )
    print(
        "| row | cold samples/s | warm samples/s | warm vs (b) | warm vs (a) | "
        "warm MB/s | peak PSS MB | page cache MB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "warm" not in r:
            print(f"| {r['row']} | {r.get('status')}: {r.get('reason')} | | | | | | |")
            continue
        pc = "" if r.get("page_cache") is None else f"{r['page_cache'] / 1e6:.0f}"
        print(
            f"| {r['row']} | {r['cold']:.0f} | {r['warm']:.0f} | {r['warm'] / b:.2f} | "
            f"{r['warm'] / a:.1f} | {r['warm'] * entry / 1e6:.0f} | {r['pss'] / 1e6:.0f} | {pc} |"
        )
    print(
        "\n| disk form | bytes/sample | unpack us/sample | gather us/sample | samples in 10 GiB "
        "| warm samples/s | PSNR vs raw |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["row"].startswith(("(c)", "(f)")):
            per = r["disk_bytes_per_sample"] or entry
            form = r["row"].split("disk_form=")[-1] if "(f)" in r["row"] else "raw"
            print(
                f"| {form} | {per:.0f} | {r['unpack_us']:.0f} | {r['gather_us']:.0f} | "
                f"{(10 << 30) / per:,.0f} | "
                f"{r['warm']:.0f} | {_psnr_text(r['psnr_db'])} |"
            )
    for d in (r for r in rows if r["row"].startswith("(d)")):
        print(f"\n(d) the cache file's resident bytes after each drop: {d['resident_after_drop']}")
        print(
            f"(d) reads {d['warm'] * entry / 1e6:.0f} MB/s = "
            f"{d['warm'] * entry / bw_before:.2f} of dd's {bw_before / 1e6:.0f} MB/s"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "dd": bw_before}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
