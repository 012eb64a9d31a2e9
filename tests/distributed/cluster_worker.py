"""One rank of a ``scope="cluster"`` run under torchrun (started by test_cluster.py and
benchmarks/cluster.py): trains over a few epochs, writes what it saw to ``OUT/rank<R>.json``.

Per epoch: a digest of every batch (ids and image bytes), the samples this process
produced (decoded), the node's memory entries and bytes, the exchange's counters,
seconds; and the warnings the cluster logged (``warnings``).
``--kill-node N --kill-at E:B``: the ranks of node N stop before batch B of epoch E:
the first of them is killed (SIGKILL, a dead rank), the others freeze (SIGSTOP, a silent
peer whose connections stay open). ``--stop-at E:B``: save the loader state there and stop.
``--resume FILE``: load a state first (another world size allowed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist

from mmcache import Cache, DataLoader, MultimodalDataset
from mmcache.cluster import Cluster
from mmcache.transforms import ImageSpec
from mmcache.transforms.pipeline import Pipeline


class CountingDataset(MultimodalDataset):
    """Counts the samples this process produces (decodes)."""

    produced = 0
    which: ClassVar[list[int]] = []

    def produce(self, index: int) -> dict[str, np.ndarray]:
        CountingDataset.produced += 1
        CountingDataset.which.append(index)
        return super().produce(index)


class _Warnings(logging.Handler):
    """Keeps the messages of the warnings logged (the result's ``warnings``)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def digest(batch: dict[str, Any]) -> str:
    h = hashlib.sha1()
    h.update("\n".join(batch["id"]).encode())
    h.update(batch["image"].numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--scope", default="cluster")
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kill-node", default=None)
    ap.add_argument("--kill-at", default=None)
    ap.add_argument("--stop-at", default=None)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--lockstep", action="store_true", help="a barrier after each batch (DDP)")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--persistent", action="store_true")
    args = ap.parse_args()
    if os.environ.get("CLUSTER_DEBUG"):
        logging.basicConfig(
            level=logging.DEBUG, format=f"%(relativeCreated)d r{os.environ.get('RANK')} %(message)s"
        )
        logging.getLogger("mmcache.cluster").setLevel(logging.DEBUG)
    warned = _Warnings()  # what the exchange warned of, for the G17 tests
    logging.getLogger("mmcache.cluster").addHandler(warned)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    (out / f"pid{rank}").write_text(str(os.getpid()))  # the test kills what is left
    node = os.environ.get("MMCACHE_NODE", "")
    # "{node}" in the manifest: each node reads its own copy of the data (cp -a on each node)
    manifest = args.manifest.replace("{node}", node)
    ds = CountingDataset(manifest, pipeline=Pipeline(image=ImageSpec(size=args.size)))
    scope = Cluster(peer_timeout=args.timeout) if args.scope == "cluster" else "node"
    cache = Cache(args.root, memory=args.budget, scope=scope, temporary=True)
    loader = DataLoader(
        ds, cache=cache, batch_size=args.batch, seed=7, num_workers=args.workers,
        persistent_workers=args.persistent,
    )  # fmt: skip
    first = 0
    if args.resume:
        state = json.loads(Path(args.resume).read_text())
        loader.load_state_dict(state)
        first = state["epoch"]
    kill = tuple(map(int, args.kill_at.split(":"))) if args.kill_at else None
    stop = tuple(map(int, args.stop_at.split(":"))) if args.stop_at else None
    epochs: list[dict[str, Any]] = []
    result: dict[str, Any] = {"rank": rank, "node": node, "epochs": epochs}
    dist.barrier()
    for epoch in range(first, args.epochs):
        loader.set_epoch(epoch)
        before = CountingDataset.produced
        t0 = time.perf_counter()
        seen = []
        ids: list[str] = []
        flight_max = 0  # entries in the node's in-flight tier, the most seen after a batch
        for j, batch in enumerate(loader):
            flight = cache.side_tier("flight")
            if flight is not None:
                flight_max = max(flight_max, len(flight))
            if kill is not None and node == args.kill_node and (epoch, j) == kill:
                first = int(os.environ.get("LOCAL_RANK", "0")) == 0
                os.kill(os.getpid(), signal.SIGKILL if first else signal.SIGSTOP)
            seen.append(digest(batch))
            ids += batch["id"]
            if args.lockstep:
                dist.barrier()
            if stop is not None and (epoch, j + 1) == stop:
                result["state"] = loader.state_dict()
                break
        memory = cache.memory
        exchange = loader.exchange
        if args.lockstep and "state" not in result:
            time.sleep(0.3)  # the exchange thread deletes the last window's entries
            dist.barrier()
        epochs.append(
            {
                "epoch": epoch,
                "batches": seen,
                "ids": ids,
                "produced": CountingDataset.produced - before,
                "produced_which": CountingDataset.which[before:],
                "misses": loader.stats().epochs[-1].misses,  # workers' productions too
                "seconds": time.perf_counter() - t0,
                "memory_items": len(list(memory.keys())) if memory is not None else 0,
                "memory_bytes": memory.nbytes() if memory is not None else 0,
                "exchange": exchange.stats().as_dict() if exchange is not None else None,
                "flight_max": flight_max,
                "flight_bound": exchange.flight_entries if exchange is not None else 0,
            }
        )
        if "state" in result:
            break
    result["warnings"] = warned.messages
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if kill is None and stop is None:
        dist.barrier()  # everyone done before the memory tiers go
    loader.close()
    cache.close()
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown: a dead peer would make it wait


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
