"""The control plane at 10^6-10^8 samples without data (issue 41): a synthetic source (ids
and stamps, no bytes) driven through open, the plan of an epoch, keys, ``state_dict`` /
``load_state_dict``, elastic resume and the production claims; CPU, wall and memory per
sample for each phase.

Each phase runs in a fresh process (as ``scale.py``'s do, with its CPU and memory
helpers): the source is opened first (without the repeated-id check, which the ``open``
phase measures), then the phase's step of :mod:`mmcache.testing.control_plane` runs
between two measures:

- CPU (this process's rusage) and wall time, per sample of the dataset (``keys``: per
  sample keyed, ``--keys-max`` of them; ``claims``: per claim, ``--claims`` of them);
- memory kept when the step is done (psutil USS, private pages, and the ``Anonymous``
  heap of ``/proc/self/smaps_rollup``) and its peak (``VmHWM`` reset before the step
  through ``/proc/self/clear_refs``), each per sample of the dataset, over the start.

The phases:

- ``open``: the source made (ids "s0000000042" as a UTF-8 column, the repeated-id check);
- ``plan``: a DataLoader (no cache, no workers) and the first batch of two epochs: each
  epoch's order (the sampler's permutation) and the loader's batches of it, remembered;
- ``keys``: ``key_rows`` over epoch 0's order batch by batch (a new run's first epoch:
  stamps, identity text, hash, the source's key memo of N rows);
- ``state``: ``state_dict`` after three batches, a new loader's ``load_state_dict`` and
  its first batch (each step's time in the notes);
- ``resume``: ``--world-from`` ranks each take three batches and one saves; ``--world-to``
  ranks each load the state and take their first batch; their plans of the rest and
  what the first job consumed are counted: each remaining sample exactly once (the
  padding of ``Distributed(drop_last=False)`` aside);
- ``claims``: each of ``--claims`` keys claimed and released (``Claims`` on a lock file).

    PYTHONPATH=src python benchmarks/control_plane.py [--n 1000000] [--phases open,plan]

Prints a markdown table per N (and the log-log slope between the smallest and largest N
when several are given) and writes ``benchmarks/results/control_plane.json`` and
``.md`` with the commit and machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from scale import RESULTS, delta, machine, meminfo, snap  # noqa: E402

PHASES = ("open", "plan", "keys", "state", "resume", "claims")
#: Batches the saving job takes before ``state_dict`` (state and resume phases).
AFTER = 3


# -- memory -------------------------------------------------------------------------------
def reset_peak() -> None:
    """Make ``VmHWM`` (the peak resident memory) start again from the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass  # then the peak is the process's since it started (an upper bound)


def peak_rss() -> int:
    """``VmHWM`` of this process, bytes (ru_maxrss where /proc is not there)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- one phase in this process ---------------------------------------------------------------
class Phase:
    """One phase at one N: what it sets up first, and its step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n: int = args.n
        self.marks: list[tuple[str, dict[str, Any]]] = []
        self.kept: Any = None  # what the step made, alive while memory is measured

    def mark(self, step: str) -> None:
        self.marks.append((step, snap()))

    def source(self) -> Any:
        from mmcache.testing.synthetic import SyntheticSource

        return SyntheticSource(self.n, ids=self.args.ids, check_ids=False)

    def run(self) -> dict[str, Any]:
        from mmcache.testing import control_plane as cp
        from mmcache.testing.synthetic import SyntheticSource

        name, args, n = self.args.phase, self.args, self.n
        src = None if name == "open" else self.source()
        facts: dict[str, Any] = {}
        step: Any
        if name == "open":
            step = lambda: SyntheticSource(n, ids=args.ids)  # noqa: E731
        elif name == "plan":
            step = lambda: cp.plan_epochs(src, batch_size=args.batch, epochs=2)  # noqa: E731
        elif name == "keys":
            from mmcache.sampler import EpochSampler

            order = EpochSampler(n, seed=0).permutation(0)[: args.keys_max].copy()
            facts["keyed"] = int(order.shape[0])
            step = lambda: cp.key_order(src, order, batch_size=args.batch)  # noqa: E731
        elif name == "state":
            step = lambda: cp.save_and_resume(  # noqa: E731
                src, batch_size=args.batch, after=AFTER, mark=self.mark
            )
        elif name == "resume":
            step = lambda: cp.elastic_resume(  # noqa: E731
                src,
                batch_size=args.batch,
                world_from=args.world_from,
                world_to=args.world_to,
                after=AFTER,
                mark=self.mark,
            )
        elif name == "claims":
            import numpy as np

            keys = src.key_rows(np.arange(min(n, args.claims), dtype=np.int64)).copy()
            lock = tempfile.NamedTemporaryFile(prefix="mmcache-claims-")  # noqa: SIM115
            facts["claimed"] = int(keys.shape[0])
            step = lambda: cp.claim_keys(lock.name, keys)  # noqa: E731
        else:
            raise SystemExit(f"unknown phase {name!r}")
        before = meminfo(os.getpid())
        reset_peak()
        start = snap()
        self.mark("start")
        self.kept = step()
        timing = delta(start, snap())
        after = meminfo(os.getpid())
        peak = peak_rss()
        out: dict[str, Any] = {
            "timing": timing,
            "before": before,
            "after": after,
            "peak_over_start": peak - before.get("rss", 0),
            "steps": [
                {"step": b[0], **delta(a[1], b[1])}
                for a, b in zip(self.marks, self.marks[1:], strict=False)
            ],
            **facts,
        }
        if name == "open":
            out["source_bytes"] = self.kept.nbytes
        if name == "resume":
            a = snap()
            cov = cp.coverage(n, self.kept)
            out["check"] = {**delta(a, snap()), **cov.__dict__}
            out["remaining"] = [int(p.shape[0]) for p in self.kept.remaining]
            out["consumed"] = int(self.kept.consumed.shape[0])
            out["state_bytes"] = len(json.dumps(self.kept.state))
        if name == "state":
            out["state_bytes"] = len(json.dumps(self.kept[0]))
        if name == "claims":
            out["held"] = self.kept
            lock.close()
        return out


def run_phase(args: argparse.Namespace) -> None:
    a = snap()
    import torch  # noqa: F401

    import mmcache  # noqa: F401

    result = {"import": delta(a, snap()), **Phase(args).run()}
    Path(args.result).write_text(json.dumps(result, indent=1, default=str))


# -- the driver ---------------------------------------------------------------------------
def run_child(args: argparse.Namespace, phase: str, n: int) -> dict[str, Any]:
    out = Path(tempfile.gettempdir()) / f"control-plane-{os.getpid()}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--phase", phase, "--n", str(n), "--result", str(out)]
    cmd += ["--batch", str(args.batch), "--ids", args.ids, "--keys-max", str(args.keys_max)]
    cmd += ["--claims", str(args.claims)]
    cmd += ["--world-from", str(args.world_from), "--world-to", str(args.world_to)]
    print(f"== N={n:,} {phase} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    result: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return result


def _per_sample(r: dict[str, Any], n: int, what: str) -> float:
    if what == "peak":
        return float(r["peak_over_start"]) / n
    return float(r["after"].get(what, 0) - r["before"].get(what, 0)) / n


def _divisor(r: dict[str, Any], n: int) -> int:
    """What a phase's time is per: the samples keyed, the claims, else the dataset."""
    return int(r.get("keyed") or r.get("claimed") or n)


def _notes(phase: str, r: dict[str, Any]) -> str:
    steps = "; ".join(f"{s['step']} {s['self_cpu']:.2f} s" for s in r.get("steps", []))
    if phase == "open":
        return f"ids column {r['source_bytes'] / r['n']:.0f} B/sample"
    if phase == "keys":
        return f"{r['keyed']:,} samples keyed (time per sample keyed)"
    if phase == "claims":
        return f"{r['held']:,} of {r['claimed']:,} claims held (time per claim)"
    if phase == "state":
        return f"{steps}; state {r['state_bytes']} B (JSON)"
    if phase == "resume":
        c = r["check"]
        shape = f"{r['consumed']:,} consumed, {len(r['remaining'])} ranks x {r['remaining'][0]:,}"
        seen = f"never {c['never']}, again {c['again']}, repeated {c['repeats']}"
        return f"{shape}; {seen}; {steps}"
    return steps


def table(n: int, runs: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"N = {n:,}",
        "",
        "| phase | CPU (us/sample) | wall (us/sample) | USS kept (B/sample) | heap kept "
        "(B/sample) | peak over start (B/sample) | notes |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for phase, r in runs.items():
        r["n"] = n
        per = _divisor(r, n)
        t = r["timing"]
        cells = [
            f"{1e6 * t['self_cpu'] / per:,.3f}",
            f"{1e6 * t['wall'] / per:,.3f}",
            f"{_per_sample(r, n, 'uss'):,.1f}",
            f"{_per_sample(r, n, 'anonymous'):,.1f}",
            f"{_per_sample(r, n, 'peak'):,.1f}",
        ]
        lines.append(f"| {phase} | " + " | ".join(cells) + f" | {_notes(phase, r)} |")
    return "\n".join(lines)


def slopes(results: dict[int, dict[str, dict[str, Any]]]) -> list[str]:
    """Each phase's exponent b between the smallest and largest N: of its CPU per unit of
    work (a sample, a key, a claim) times N, and of its peak memory (b = 1: linear; below:
    a fixed part amortised; above: super-linear)."""
    ns = sorted(results)
    if len(ns) < 2:
        return []
    a, b = ns[0], ns[-1]
    span = math.log(b / a)
    out = []
    for phase, rb in results[b].items():
        ra = results[a].get(phase)
        if ra is None:
            continue
        unit_a = ra["timing"]["self_cpu"] / _divisor(ra, a)
        unit_b = rb["timing"]["self_cpu"] / _divisor(rb, b)
        cpu = 1 + math.log(max(unit_b, 1e-12) / max(unit_a, 1e-12)) / span
        peak = math.log(max(rb["peak_over_start"], 1) / max(ra["peak_over_start"], 1)) / span
        out.append(
            f"{phase} {a:,} -> {b:,}: CPU exponent {cpu:.2f}, peak memory exponent {peak:.2f}"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="1000000", help="comma-separated sample counts (1e8: full)")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--ids", default="strings", choices=("strings", "positions"))
    ap.add_argument("--keys-max", type=int, default=10_000_000, help="samples keyed at most")
    ap.add_argument("--claims", type=int, default=100_000, help="keys claimed")
    ap.add_argument("--world-from", type=int, default=4)
    ap.add_argument("--world-to", type=int, default=3)
    ap.add_argument("--tag", default="control_plane", help="name of the result files")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        args.n = int(float(args.n))
        run_phase(args)
        return
    info: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    info["started"] = time.strftime("%Y-%m-%d %H:%M:%S")
    results: dict[int, dict[str, dict[str, Any]]] = {}
    RESULTS.mkdir(exist_ok=True)
    for n in (int(float(v)) for v in args.n.split(",") if v):
        results[n] = {}
        for phase in (p for p in args.phases.split(",") if p):
            results[n][phase] = run_child(args, phase, n)
            # After each phase: a run stopped later (out of memory at 10^8) keeps these.
            record = {**info, "load_average_end": os.getloadavg()[0], "results": results}
            (RESULTS / f"{args.tag}.json").write_text(json.dumps(record, indent=1, default=str))
    end = os.getloadavg()[0]
    m = info["machine"]
    head = ", ".join(
        [
            f"mmcache at commit {m['commit']} ({m['mmcache']})",
            f"{m['cpu']} ({m['cores']} cores)",
            f"load average {m['load_average'][0]:.1f} at start, {end:.1f} at end",
            f"batch {args.batch}, ids {args.ids}",
            f"resume {args.world_from} -> {args.world_to} ranks",
            "memory in bytes per sample of the dataset, over the phase's start",
        ]
    )
    report = "\n\n".join([head, *(table(n, r) for n, r in results.items())])
    report += "".join(f"\n- {s}" for s in slopes(results)) + "\n"
    print(report)
    (RESULTS / f"{args.tag}.md").write_text(report)


if __name__ == "__main__":
    main()
