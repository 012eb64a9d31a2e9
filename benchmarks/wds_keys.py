"""A new process's keying of every sample of a WebDataset set (issue 41: key tables).

Makes the ``wds`` set of ``--n`` tiny samples (:mod:`scale_data`), keys every sample once in
a first process (member indexes, span digests in the ledger, the key table filled), then,
in a second fresh process, keys every sample again in batches of 256 and prints
``keys.sample_key`` calls and CPU per sample, and the process's USS and anonymous memory
growth. Run it with
each tree's sources first on the path to compare them:

    PYTHONPATH=src python benchmarks/wds_keys.py --n 100000 --work /tmp/wdskeys-bench

The ledger and the key tables live under ``--work/<label>`` (``--label``), so that two trees
compared do not share them; the dataset is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import scale_data  # noqa: E402


def _key_all(data: Path, tok: Path) -> dict[str, float]:
    """Open the set and key every sample: what it cost (in this process)."""
    import psutil

    import mmcache as mc
    from mmcache import keys
    from mmcache.sources import WebDatasetSource

    calls = [0]
    real = keys.sample_key

    def counted(*args: object) -> bytes:
        calls[0] += 1
        return real(*args)  # type: ignore[arg-type]

    keys.sample_key = counted  # type: ignore[assignment]
    pipe = mc.Pipeline(image=mc.ImageSpec(size=32), text=mc.TextSpec(str(tok), max_length=16))
    me = psutil.Process()
    t0 = time.process_time()
    src = WebDatasetSource(str(data / "*.tar"), pipeline=pipe, index_dir=data.parent / "idx")
    opened = time.process_time() - t0
    uss0, anon0 = me.memory_full_info().uss, _anon()
    t0, w0 = time.process_time(), time.perf_counter()
    n = len(src)
    for start in range(0, n, 256):
        src.key_rows(range(start, min(n, start + 256)))
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    uss, anon = me.memory_full_info().uss - uss0, _anon() - anon0
    return {
        "n": n,
        "open_cpu_s": round(opened, 3),
        "sample_key_calls": calls[0],
        "key_cpu_us_per_sample": round(cpu / n * 1e6, 2),
        "key_wall_us_per_sample": round(wall / n * 1e6, 2),
        "uss_growth_b_per_sample": round(uss / n, 1),
        "anon_growth_b_per_sample": round(anon / n, 1),
    }


def _anon() -> int:
    """This process's resident anonymous memory (``RssAnon``), bytes: its own heap and
    private maps, not the pages of files it maps (a key table's, which USS counts while no
    other process maps them)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--work", type=Path, default=HERE / "results" / "wds-keys")
    parser.add_argument("--label", default="this")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    data = scale_data.ensure(args.work, "wds", args.n)
    tok = scale_data.tokenizer(args.work)
    if args.child:
        print(json.dumps(_key_all(data, tok)))
        return
    env = dict(os.environ)
    env.setdefault("MMCACHE_COLUMNS_DIR", str(args.work / args.label / "columns"))
    env.setdefault("MMCACHE_IDENTITY_DIR", str(args.work / args.label / "identity"))
    time.sleep(4)  # older than the racy window (identity.RACY_SECONDS)
    argv = [sys.executable, __file__, "--n", str(args.n), "--work", str(args.work), "--child"]
    for run in ("first", "second"):
        out = subprocess.run(argv, env=env, check=True, stdout=subprocess.PIPE, text=True)
        print(json.dumps({"label": args.label, "run": run, **json.loads(out.stdout)}))


if __name__ == "__main__":
    main()
