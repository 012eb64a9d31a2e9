"""This tree against a commit, in turns: the mechanism of the benchmarks' ``--compare REF``.

:func:`compare_trees` checks the commit ``REF`` out into a temporary git worktree, then for
each round runs the benchmark's one-measurement mode once per tree, each in a fresh process
importing mmcache from that tree's ``src`` (``PYTHONPATH``), alternating which tree goes
first, on the same data (a folder both runs are given with ``--data``: the first run
generates it, the others reuse it). Each run prints one JSON object of figures as its last
line; the medians per tree and their quotients are printed as a Markdown table. Taking the
trees in turns puts the same machine noise on both; a single A-then-B run on a shared
machine cannot tell an 8% change from the noise.

The script is always *this* tree's benchmark (only the library comes from REF), so the
measurement is the same code on both sides. Used by ``benchmarks/loader.py`` and
``benchmarks/sources.py``. Not thread-safe (one comparison at a time per process).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["compare_trees"]


def compare_trees(
    ref: str,
    *,
    script: Path,
    argv: Sequence[str],
    rounds: int,
    figures: Mapping[str, str],
) -> dict[str, dict[str, float]]:
    """Run ``script argv --data DIR`` ``rounds`` times per tree (this one and ``ref``), in
    turns; print each round's ``figures`` (JSON key -> label), then the medians and the
    quotients this tree / ref. Returns ``{tree: {figure: median}}``."""
    here = Path(__file__).resolve().parents[1]
    tmp = Path(tempfile.mkdtemp(prefix="mmcache-bench-compare-"))
    ref_tree = tmp / "ref"
    subprocess.run(
        ["git", "-C", str(here), "worktree", "add", "--detach", "-q", str(ref_tree), ref],
        check=True,
    )
    trees = {"this tree": here, f"ref {ref}": ref_tree}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    try:
        for r in range(rounds):
            # Alternate which tree goes first, so neither always runs on a warmer machine.
            order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
            for name, tree in order:
                env = {**os.environ, "PYTHONPATH": str(tree / "src")}
                out = subprocess.run(
                    [sys.executable, str(script), *argv, "--data", str(tmp / "data")],
                    env=env,
                    check=True,
                    capture_output=True,
                    text=True,
                )
                row = json.loads(out.stdout.strip().splitlines()[-1])
                results[name].append(row)
                shown = ", ".join(f"{label} {row[key]:.3f}" for key, label in figures.items())
                print(f"round {r}: {name}: {shown}", flush=True)
    finally:
        subprocess.run(
            ["git", "-C", str(here), "worktree", "remove", "--force", str(ref_tree)], check=False
        )
        shutil.rmtree(tmp, ignore_errors=True)
    med = {
        name: {key: statistics.median(row[key] for row in rows) for key in figures}
        for name, rows in results.items()
    }
    print()
    print(f"| tree (medians of {rounds} rounds) | {' | '.join(figures.values())} |")
    print("|---|" + "---:|" * len(figures))
    for name, values in med.items():
        print(f"| {name} | {' | '.join(f'{values[k]:.3f}' for k in figures)} |")
    mine, theirs = med.values()
    quotients = ", ".join(f"{label} {mine[k] / theirs[k]:.3f}" for k, label in figures.items())
    print(f"\nthis tree / ref: {quotients}")
    return med
