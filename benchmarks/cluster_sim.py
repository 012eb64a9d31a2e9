"""Cluster caching on paper (issue 18): storage reads and network bytes per epoch at scale.

No processes: W nodes (1 rank each), N samples, a per-node memory budget C (a
fraction of the data), one epoch of the loader's own order (``EpochSampler``:
rank r reads positions r, r+W, ... of the epoch's permutation). For each policy:

- **node-local** (``scope="node"``, every peer library): each node caches what it
  reads; a random epoch finds a fraction min(1, C/N) of its reads there (steady
  state, analytic). Network (peer) bytes: none.
- **partitioned** (CoorDL): the dataset split in W equal shares, each node
  caching its share up to its budget; reads of a cached sample by another node
  cross the network.
- **mmcache** (``scope="cluster"``): ``mmcache.cluster.placement.home_nodes``, the
  partition weighted by the nodes' budgets, computed here with the real function
  on the real N; a node holds its share up to its budget.

The aggregate bound: storage reads >= max(0, N - sum of budgets). With equal
budgets partitioned and mmcache coincide (and meet the bound); with unequal
budgets (half the nodes at 1.5 C, half at 0.5 C, same total), equal shares
overflow the small nodes and the weighted placement still meets the bound.
NoPFS's frequency-based placement refines this for skewed access; with a random
permutation every sample is read once per epoch, so it has nothing to add.

    .venv/bin/python benchmarks/cluster_sim.py           # N = 10M, 8..512 nodes
    .venv/bin/python benchmarks/cluster_sim.py --quick   # N = 1M
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from mmcache.cluster.placement import home_nodes, shares
from mmcache.sampler import EpochSampler

NODES = (8, 10, 12, 16, 20, 24, 32, 48, 64, 128, 256, 512)
BUDGETS = (0.05, 0.10, 0.25, 0.50)
#: One cached 224 px RGB sample (uint8 [3, 224, 224]) plus the entry header.
ENTRY_BYTES = 3 * 224 * 224 + 128


def _rank_in_node(home: np.ndarray) -> np.ndarray:
    """Each sample's position within its home node's share (a node holds its first
    ``C`` samples: never more than its budget)."""
    order = np.argsort(home, kind="stable")
    counts = np.bincount(home)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    out = np.empty_like(order)
    out[order] = np.arange(order.shape[0]) - np.repeat(starts, counts)
    return out


class _Sim:
    """The arrays of one N, computed once: the epoch's order, each placement."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n = n
        self.seed = seed
        perm = EpochSampler(n, seed=seed).permutation(1)
        self.position = np.empty(n, dtype=np.int64)
        self.position[perm] = np.arange(n)  # rank r takes positions r, r + W, ...
        self._memo: dict[tuple[str, int, bool], tuple[np.ndarray, np.ndarray]] = {}

    def placement(self, kind: str, nodes: int, mixed: bool) -> tuple[np.ndarray, np.ndarray]:
        """(home node, rank in node) of every sample."""
        key = (kind, nodes, mixed and kind == "mmcache")
        if key not in self._memo:
            if kind == "partitioned":
                counts = shares(self.n, [1.0] * nodes)
                equal = np.repeat(np.arange(nodes, dtype=np.int32), counts)
                rng = np.random.Generator(np.random.PCG64(self.seed))
                home = equal[rng.permutation(self.n)]
            else:
                home = home_nodes(self.n, _weights(nodes, mixed).tolist(), self.seed)
            self._memo[key] = (home, _rank_in_node(home))
        return self._memo[key]

    def epoch(self, kind: str, caps: np.ndarray, mixed: bool) -> tuple[int, int]:
        """(storage reads, samples sent between nodes) of one epoch."""
        nodes = caps.shape[0]
        home, rank_in = self.placement(kind, nodes, mixed)
        held = rank_in < caps[home]
        reader = self.position % nodes
        return int(self.n - held.sum()), int((held & (reader != home)).sum())


def _weights(nodes: int, mixed: bool) -> np.ndarray:
    w = np.ones(nodes)
    if mixed:  # half the nodes with 1.5x the budget, half with 0.5x: same total
        w[: nodes // 2], w[nodes // 2 :] = 1.5, 0.5
    return w


def simulate(sim: _Sim, nodes: int, budget: float, mixed: bool) -> dict[str, Any]:
    n = sim.n
    caps = (_weights(nodes, mixed) * budget * n).astype(np.int64)
    bound = max(0, n - int(caps.sum()))
    local = round(sum(n / nodes * (1 - min(1.0, c / n)) for c in caps))
    p_reads, p_sent = sim.epoch("partitioned", caps, mixed)
    m_reads, m_sent = sim.epoch("mmcache", caps, mixed)
    return {
        "nodes": nodes,
        "budget": budget,
        "mixed": mixed,
        "bound": bound,
        "node_local_reads": local,
        "partitioned_reads": p_reads,
        "mmcache_reads": m_reads,
        "partitioned_net_bytes": p_sent * ENTRY_BYTES,
        "mmcache_net_bytes": m_sent * ENTRY_BYTES,
    }


def _plot(rows: list[dict[str, Any]], n: int, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=110)
    axes = fig.subplots(1, 2, sharey=True)
    colors = dict(zip(BUDGETS, ("#4C72B0", "#55A868", "#C44E52", "#8172B2"), strict=True))
    for ax, mixed in zip(axes, (False, True), strict=True):
        for b in BUDGETS:
            sel = [r for r in rows if r["budget"] == b and r["mixed"] == mixed]
            xs = [r["nodes"] for r in sel]
            c = colors[b]
            ax.plot(xs, [r["node_local_reads"] / n for r in sel], ":", color=c)
            ax.plot(xs, [r["partitioned_reads"] / n for r in sel], "--", color=c)
            ax.plot(xs, [r["mmcache_reads"] / n for r in sel], "o-", color=c,
                    label=f"C = {b:.0%} of N")  # fmt: skip
            ax.plot(xs, [r["bound"] / n for r in sel], "x", color="k", ms=4)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes W")
        ax.set_title(
            "unequal budgets (half 1.5 C, half 0.5 C)" if mixed else "equal budgets C per node"
        )
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("storage reads per epoch / N")
    axes[0].legend(fontsize="small", title="o-: mmcache, --: partitioned, :: node-local, x: bound")
    fig.suptitle(f"Storage reads per epoch, N = {n:,} samples")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    n = 1_000_000 if args.quick else args.n
    t0 = time.perf_counter()
    sim = _Sim(n)
    rows = [simulate(sim, w, b, mixed) for mixed in (False, True) for w in NODES for b in BUDGETS]
    rows.sort(key=lambda r: (r["mixed"], r["budget"], r["nodes"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster_sim.json").write_text(json.dumps({"n": n, "rows": rows}, indent=1))
    _plot(rows, n, out / "cluster_sim.png")
    print(f"N = {n:,}, entry {ENTRY_BYTES:,} B, {time.perf_counter() - t0:.0f} s")
    print("storage reads per epoch / N; network: GiB received per node per epoch (mmcache)")
    print("| budgets | W | C | bound | node-local | partitioned | mmcache | net GiB/node |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["nodes"] not in (8, 16, 20, 32, 512):
            continue
        print(
            f"| {'mixed' if r['mixed'] else 'equal'} | {r['nodes']} | {r['budget']:.0%} "
            f"| {r['bound'] / n:.3f} | {r['node_local_reads'] / n:.3f} "
            f"| {r['partitioned_reads'] / n:.3f} | {r['mmcache_reads'] / n:.3f} "
            f"| {r['mmcache_net_bytes'] / r['nodes'] / 2**30:,.1f} |"
        )


if __name__ == "__main__":
    main()
