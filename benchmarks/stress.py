"""Stress: many processes (fork and spawn) reading and writing one node-shared cache.

Every process opens the same :class:`mmcache.Cache` (a node-shared memory tier of
about an eighth of the data, so it evicts all the time, and a disk tier that holds
everything) and, until a common deadline, mixes ``Cache.get``, ``Cache.put`` and
``Cache.get_or_produce`` on a key space whose values are a deterministic function of
the key (four sample sizes, 0.2 KB to 77 KB, so several size classes and both copy
paths of the memory tier). It checks every value it reads and the budgets of both
tiers as it goes. At the end the parent checks the whole cache: the memory tier's
invariants (``MemoryStore.check``), the disk tier's recorded totals against its
contents, every checksum (``Cache.verify``), and that every key anyone put is still
on disk with its value (the disk budget holds the whole key space, so nothing may be
missing: "no lost value").

    .venv/bin/python benchmarks/stress.py                    # 60 s, 8 processes
    .venv/bin/python benchmarks/stress.py --seconds 10 --json

Prints a summary (JSON with ``--json``) and exits 1 if anything was wrong, lost or
over budget, or any process failed. ``tests/multiproc/test_load.py`` runs it for 10 s.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from mmcache.cache import Cache, _memory_name
from mmcache.keys import sample_key
from mmcache.stores.memory.cleanup import unlink_store
from mmcache.units import parse_size

SIDES = (8, 32, 96, 160)  # image sides: 192 B, 3 KB, 28 KB, 77 KB (> the 64 KiB inline copy)


def key_of(k: int) -> bytes:
    return sample_key(f"stress-{k}", "0:0", "stress-pipeline", f"caption {k}")


def value_of(k: int) -> dict[str, np.ndarray]:
    """The sample of key ``k``: every byte depends on ``k``, so a torn, mixed or
    misplaced value never passes for the right one."""
    side = SIDES[k % len(SIDES)]
    rng = np.random.default_rng(k)
    return {
        "image": rng.integers(0, 256, (3, side, side), dtype=np.uint8),
        "input_ids": np.arange(16, dtype=np.int32) * 7 + k,
        "k": np.array([k], dtype=np.int64),
    }


def same(a: Any, b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype and np.array_equal(a[n], b[n]) for n in b
    )


def open_cache(cfg: dict[str, Any]) -> Cache:
    return Cache(cfg["root"], memory=cfg["memory"], disk=cfg["disk"], policy=cfg["policy"])


def worker(wid: int, cfg: dict[str, Any]) -> None:
    """One process: ops until the deadline in the go file; writes its result file."""
    out = Path(cfg["dir"]) / f"result-{wid}.json"
    result: dict[str, Any] = {
        "wid": wid,
        "start": cfg["starts"][wid],
        "pid": os.getpid(),
        "ops": 0,
        "gets": 0,
        "hits": {"memory": 0, "disk": 0},
        "puts": 0,
        "admitted": 0,
        "produced": 0,
        "wrong": 0,
        "budget_violations": 0,
        "errors": [],
        "put_keys": [],
    }
    try:
        values = [value_of(k) for k in range(cfg["keys"])]
        keys = [key_of(k) for k in range(cfg["keys"])]
        cache = open_cache(cfg)
        (Path(cfg["dir"]) / f"ready-{wid}").touch()
        go = Path(cfg["dir"]) / "go"
        while not go.exists():
            time.sleep(0.01)
        deadline = float(go.read_text())
        rng = np.random.default_rng(1000 + wid)
        put_keys: set[int] = set()
        memory, disk = cache.memory, cache.disk
        assert memory is not None and disk is not None
        while time.time() < deadline:
            k = int(rng.integers(0, cfg["keys"]))
            r = float(rng.random())
            try:
                if r < 0.5:
                    result["gets"] += 1
                    sample, tier = cache.lookup(keys[k])
                    if sample is not None and tier is not None:
                        result["hits"][tier] += 1
                        if not same(sample, values[k]):
                            result["wrong"] += 1
                elif r < 0.85:
                    result["puts"] += 1
                    put_keys.add(k)
                    result["admitted"] += cache.put(keys[k], values[k], cost=float(rng.random()))
                elif r < 0.95:

                    def produce(k: int = k) -> dict[str, np.ndarray]:
                        result["produced"] += 1
                        return value_of(k)

                    put_keys.add(k)
                    if not same(cache.get_or_produce(keys[k], produce), values[k]):
                        result["wrong"] += 1
                else:
                    over = memory.nbytes() > memory.capacity() or disk.nbytes() > disk.capacity()
                    result["budget_violations"] += over
            except Exception as exc:  # count and go on: the summary shows every kind
                if len(result["errors"]) < 5:
                    result["errors"].append(f"{type(exc).__name__}: {exc}")
                else:
                    result["errors"].append("...")
            result["ops"] += 1
        cache.close()
        result["put_keys"] = sorted(put_keys)
    except Exception:
        result["errors"].append(traceback.format_exc())
    out.write_text(json.dumps(result))


def final_check(cfg: dict[str, Any], put_keys: set[int]) -> dict[str, Any]:
    """The whole cache after every process is gone."""
    with open_cache(cfg) as cache:
        memory, disk = cache.memory, cache.disk
        assert memory is not None and disk is not None
        problems = memory.check()  # type: ignore[attr-defined]
        recorded = [disk.nbytes(), len(disk)]
        rebuilt = list(disk.rebuild_totals())  # type: ignore[attr-defined]
        verify = cache.verify()
        lost = wrong = 0
        for k in sorted(put_keys):
            raw = disk.get(key_of(k))
            if raw is None:
                lost += 1
                continue
            got = cache.get(key_of(k))
            wrong += got is None or not same(got, value_of(k))
        return {
            "memory_problems": problems,
            "memory_bytes": memory.nbytes(),
            "memory_budget": memory.capacity(),
            "memory_items": len(memory),
            "disk_totals_recorded": recorded,
            "disk_totals_rebuilt": rebuilt,
            "disk_budget": disk.capacity(),
            "verify_bad": len(verify.bad),
            "verify_checked": verify.checked,
            "lost": lost,
            "wrong_at_end": wrong,
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="mmcache-stress-"))
    root = Path(args.root) if args.root else work / "cache"
    starts = [m.strip() for m in args.start.split(",")]
    cfg: dict[str, Any] = {
        "root": str(root),
        "dir": str(work),
        "memory": parse_size(args.memory),
        "disk": args.disk,
        "policy": args.policy,
        "keys": args.keys,
        "starts": [starts[i % len(starts)] for i in range(args.procs)],
    }
    try:
        open_cache(cfg).close()  # create both tiers with the budgets before anyone joins
        procs = []
        for wid in range(args.procs):
            ctx = mp.get_context(cfg["starts"][wid])
            p = ctx.Process(target=worker, args=(wid, cfg), name=f"stress-{wid}")
            p.start()
            procs.append(p)
        t0 = time.time()
        while time.time() - t0 < args.start_timeout:
            ready = sum((work / f"ready-{w}").exists() for w in range(args.procs))
            dead = [p for p in procs if p.exitcode is not None]
            if ready == args.procs or dead:
                break
            time.sleep(0.05)
        started = time.time()
        # Written whole, then renamed: a worker polling for the file never reads it half written.
        (work / "go.tmp").write_text(repr(started + args.seconds))
        os.replace(work / "go.tmp", work / "go")
        for p in procs:
            p.join(args.seconds + 120)
        for p in procs:  # a hung process is a failure, and is not left behind
            if p.exitcode is None:
                p.kill()
                p.join(10)
        elapsed = time.time() - started
        results = []
        for wid in range(args.procs):
            path = work / f"result-{wid}.json"
            results.append(json.loads(path.read_text()) if path.exists() else None)
        put_keys = {k for r in results if r for k in r["put_keys"]}
        final = final_check(cfg, put_keys)
        ops = sum(r["ops"] for r in results if r)
        summary: dict[str, Any] = {
            "procs": args.procs,
            "starts": {s: cfg["starts"].count(s) for s in starts},
            "seconds": round(elapsed, 1),
            "ops": ops,
            "ops_per_s": round(ops / max(elapsed, 1e-9)),
            "gets": sum(r["gets"] for r in results if r),
            "memory_hits": sum(r["hits"].get("memory", 0) for r in results if r),
            "disk_hits": sum(r["hits"].get("disk", 0) for r in results if r),
            "puts": sum(r["puts"] for r in results if r),
            "produced": sum(r["produced"] for r in results if r),
            "keys_put": len(put_keys),
            "wrong": sum(r["wrong"] for r in results if r) + final["wrong_at_end"],
            "lost": final["lost"],
            "budget_violations": sum(r["budget_violations"] for r in results if r),
            "errors": [e for r in results if r for e in r["errors"]],
            "failed_procs": [
                f"{p.name} ({p.exitcode})"
                for p, r in zip(procs, results, strict=True)
                if r is None or p.exitcode != 0
            ],
            "ops_by_start": {
                s: sum(r["ops"] for r in results if r and r["start"] == s) for s in starts
            },
            "final": final,
        }
        summary["ok"] = (
            summary["wrong"] == 0
            and summary["lost"] == 0
            and summary["budget_violations"] == 0
            and not summary["errors"]
            and not summary["failed_procs"]
            and final["memory_problems"] == []
            and final["disk_totals_recorded"] == final["disk_totals_rebuilt"]
            and final["verify_bad"] == 0
            and final["memory_bytes"] <= final["memory_budget"]
        )
        return summary
    finally:
        # The memory tier lives in this user's store directory (/dev/shm/mmcache-u<uid>/);
        # it outlives the processes by design, so the run removes it.
        unlink_store(_memory_name(root.absolute()))
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--start", default="fork,spawn", help="start methods, alternating")
    parser.add_argument("--keys", type=int, default=256)
    parser.add_argument("--memory", default="1MiB", help="memory budget (data: about 7 MiB)")
    parser.add_argument("--disk", default="64MiB", help="disk budget (holds every key)")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--root", help="cache root (default: a temporary folder)")
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    summary = run(args)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        f = summary["final"]
        print(
            f"{summary['procs']} processes {summary['starts']} for {summary['seconds']} s: "
            f"{summary['ops']:,} ops ({summary['ops_per_s']:,}/s), {summary['gets']:,} gets "
            f"({summary['memory_hits']:,} memory hits, {summary['disk_hits']:,} disk hits), "
            f"{summary['puts']:,} puts, {summary['keys_put']} keys put\n"
            f"wrong {summary['wrong']}, lost {summary['lost']}, budget violations "
            f"{summary['budget_violations']}, errors {len(summary['errors'])}, failed "
            f"{summary['failed_procs']}\nmemory {f['memory_bytes']:,}/{f['memory_budget']:,} B, "
            f"{f['memory_items']} items, check {f['memory_problems']}; disk totals "
            f"{f['disk_totals_recorded']} rebuilt {f['disk_totals_rebuilt']}; verify "
            f"{f['verify_checked']} checked, {f['verify_bad']} bad\n"
            f"{'OK' if summary['ok'] else 'FAILED'}"
        )
        for err in summary["errors"][:10]:
            print("  error:", err)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
