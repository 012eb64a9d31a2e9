"""scope="node" against scope="cluster" under torchrun: 2 nodes x 1 rank on this machine.

Each "node" is a ``torchrun --nnodes 2 --node-rank K`` launcher with its own
``MMCACHE_NODE`` (its own shared-memory tier), running
``tests/distributed/cluster_worker.py`` over a synthetic dataset (32 px images,
gloo, no training step: the loader alone). Memory budget per node: 25%, 50% and
100% of the data's bytes (its entries are 3,200 B each, measured). Per epoch:
samples decoded over both nodes (misses that went to storage), bytes the exchange
moved, samples/s of the slower rank, entries in each node's memory tier, and the
most entries seen in each node's in-flight tier (scope="cluster": other homes'
samples, outside the budget).

    .venv/bin/python benchmarks/cluster.py            # N = 1024, 3 epochs
    .venv/bin/python benchmarks/cluster.py --quick    # N = 256
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mmcache.synth import make_dataset

WORKER = Path(__file__).resolve().parent.parent / "tests" / "distributed" / "cluster_worker.py"


def entry_bytes(manifest: Path) -> int:
    """Bytes of one cached entry of this data set (all have one size: 32 px images)."""
    from mmcache import codec
    from mmcache.dataset import MultimodalDataset
    from mmcache.transforms import ImageSpec
    from mmcache.transforms.pipeline import Pipeline

    ds = MultimodalDataset(manifest, pipeline=Pipeline(image=ImageSpec(size=32)))
    return len(codec.encode(ds.produce(0), ctime=0.0, cost=0.0))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(
    manifest: Path, work: Path, scope: str, budget: int, *, epochs: int, batch: int
) -> list[Any]:
    out = work / f"{scope}-{budget}"
    out.mkdir(parents=True)
    port = _port()
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    procs = []
    for k in range(2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--node-rank", str(k),
            "--rdzv-endpoint", f"127.0.0.1:{port}", str(WORKER),
            "--manifest", str(manifest), "--root", str(work / "root"),
            "--budget", str(budget), "--batch", str(batch), "--size", "32",
            "--epochs", str(epochs), "--scope", scope, "--out", str(out), "--lockstep",
        ]  # fmt: skip
        log = open(out / f"launcher{k}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            (subprocess.Popen(cmd, env={**env, "MMCACHE_NODE": f"node{k}"}, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True), log)
        )  # fmt: skip
    try:
        for p, _ in procs:
            p.wait(timeout=600)
    finally:
        for p, log in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            log.close()
    files = sorted(out.glob("rank*.json"))
    if len(files) != 2:
        raise SystemExit(f"run {out.name} failed: see {out}/launcher*.log")
    return [json.loads(f.read_text()) for f in files]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cluster.json"))
    args = ap.parse_args()
    n = 256 if args.quick else args.n
    rows = []
    with tempfile.TemporaryDirectory(prefix="mmcache-cluster-bench-") as tmp:
        work = Path(tmp)
        manifest = make_dataset(work / "data", n, seed=1)
        entry = entry_bytes(manifest)
        for frac in (0.25, 0.5, 1.0):
            for scope in ("node", "cluster"):
                t0 = time.perf_counter()
                budget = int(frac * n * entry)
                res = run(manifest, work, scope, budget, epochs=args.epochs, batch=args.batch)
                sent_before = [0, 0]
                for e in range(args.epochs):
                    eps = [r["epochs"][e] for r in res]
                    sent = [(ep["exchange"] or {}).get("sent_bytes", 0) for ep in eps]
                    rows.append(
                        {
                            "scope": scope,
                            "budget": frac,
                            "epoch": e,
                            "decoded": sum(ep["produced"] for ep in eps),
                            "exchange_bytes": sum(sent) - sum(sent_before),
                            "samples_per_s": n / max(ep["seconds"] for ep in eps),
                            "memory_items": [ep["memory_items"] for ep in eps],
                            "flight_max": [ep.get("flight_max", 0) for ep in eps],
                        }
                    )
                    sent_before = sent
                print(f"{scope} {frac:.0%}: {time.perf_counter() - t0:.0f} s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"n": n, "rows": rows}, indent=1))
    print(f"\nN = {n} samples, 2 nodes x 1 rank, batch {args.batch}")
    print(
        "| budget/node | scope | epoch | decoded | exchange MiB | samples/s | items per node "
        "| in flight (most) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['budget']:.0%} | {r['scope']} | {r['epoch']} | {r['decoded']} "
            f"| {r['exchange_bytes'] / 2**20:.1f} | {r['samples_per_s']:,.0f} "
            f"| {' / '.join(map(str, r['memory_items']))} "
            f"| {' / '.join(map(str, r['flight_max']))} |"
        )


if __name__ == "__main__":
    main()
