"""A mixture's planned order at the admission policy (issue 39): the second epoch's hit rate.

Not a test. Every figure is a ratio or a hit rate measured in the same run, side by side.

Setup: a :class:`mmcache.Mixture` of part ``A`` (``--a`` samples, ``repeat=3``) and part
``B`` (``--b`` samples, ``repeat=1``) of synthetic COCO-like JPEGs through a 64 px
pipeline; a memory tier alone (``disk=None``, policy ``value``, the default) whose budget
holds ``--fraction`` (30%) of the unique samples' entries; ``num_workers=0``. Two runs
read the same order (the same seed), epoch 0 then epoch 1:

* ``planned``: the mixture as it is: an admitted entry's miss cost is weighed by its
  part's reads per epoch (3 for ``A``, 1 for ``B``), so ``value`` keeps the samples that
  come back three times;
* ``concatenated once``: the same mixture, with every sample's planned reads 1 (what the
  cache knows when the parts are concatenated once: each sample worth its miss once).

The figure is epoch 1's hit rate of each, their ratio, and the bound: the memory holding
the most-read samples (``min(C, A) * 3 + max(0, C - A)`` hits of ``3A + B`` reads, ``C``
the entries the budget holds). Repeated ``--reps`` times (other seeds); the medians.

    PYTHONPATH=src .venv/bin/python benchmarks/mixture.py          # ~1 min on 2 busy cores

The table is printed and written to ``benchmarks/results/mixture.md``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any

import mmcache as mc
from mmcache import codec
from mmcache.synth import make_dataset, synth_captions

RESULTS = Path(__file__).resolve().parent / "results" / "mixture.md"


class ConcatenatedOnce(mc.Mixture):
    """The same mixture, its planned reads hidden from the cache: every sample 1."""

    def planned_reads(self, index: int) -> float:
        return 1.0


def _parts(data: Path, pipe: mc.Pipeline, a: int, b: int) -> list[mc.MixturePart]:
    part_a = mc.MultimodalDataset(make_dataset(data / "a", a, seed=1), pipeline=pipe)
    part_b = mc.MultimodalDataset(make_dataset(data / "b", b, seed=2), pipeline=pipe)
    return [mc.MixturePart(part_a, name="A", repeat=3), mc.MixturePart(part_b, name="B")]


def _run(mix: mc.Mixture, root: Path, budget: int, seed: int) -> dict[str, Any]:
    with mc.Cache(root, memory=budget, disk=None, temporary=True) as cache:
        loader = mc.DataLoader(mix, cache=cache, batch_size=32, seed=seed)
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
        held = cache.stats().tiers["memory"].items
        second = loader.stats().epochs[1]
        loader.close()
    return {
        "hit_rate": second.hit_rate,
        "A": second.parts["A"].hit_rate,
        "B": second.parts["B"].hit_rate,
        "held": held,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--a", type=int, default=300, help="samples of part A (repeat=3)")
    ap.add_argument("--b", type=int, default=300, help="samples of part B (repeat=1)")
    ap.add_argument("--fraction", type=float, default=0.3, help="memory for this share")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (seeds)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok = mc.train_tokenizer(synth_captions(300, seed=0), vocab_size=256)
        tok.save(str(work / "tok.json"))
        pipe = mc.Pipeline(
            image=mc.ImageSpec(size=64), text=mc.TextSpec(work / "tok.json", max_length=16)
        )
        parts = _parts(work / "data", pipe, args.a, args.b)
        planned, blind = mc.Mixture(parts), ConcatenatedOnce(parts)
        unique = planned.unique_samples
        entry = len(codec.encode(planned.produce(0)))
        budget = int(args.fraction * unique * entry)
        rows = []
        for rep in range(args.reps):
            seed = 100 + rep
            p = _run(planned, work / f"p{rep}", budget, seed)
            c = _run(blind, work / f"c{rep}", budget, seed)
            rows.append((p, c))
            print(
                f"seed {seed}: planned {p['hit_rate']:.3f} (held {p['held']}), "
                f"concatenated once {c['hit_rate']:.3f} (held {c['held']}), "
                f"ratio {p['hit_rate'] / max(c['hit_rate'], 1e-9):.2f}x",
                flush=True,
            )
    held = statistics.median(p["held"] for p, _ in rows)
    bound = (min(held, args.a) * 3 + max(0, held - args.a)) / (3 * args.a + args.b)

    def med(i: int, key: str) -> float:
        return statistics.median(r[i][key] for r in rows)

    ratio = statistics.median(p["hit_rate"] / max(c["hit_rate"], 1e-9) for p, c in rows)
    lines = [
        f"# Mixture: the planned order at the admission policy ({platform.node()})",
        "",
        f"Part A {args.a} samples repeat=3, part B {args.b} samples repeat=1; memory for "
        f"{args.fraction:.0%} of the {unique} unique samples ({held:.0f} entries held, "
        f"{entry} B each); policy value; epoch 1 after epoch 0; medians of {args.reps} seeds.",
        "",
        "| run | epoch-1 hit rate | part A | part B |",
        "|---|---|---|---|",
        f"| planned (mmcache.Mixture) | {med(0, 'hit_rate'):.3f} | {med(0, 'A'):.3f} "
        f"| {med(0, 'B'):.3f} |",
        f"| concatenated once | {med(1, 'hit_rate'):.3f} | {med(1, 'A'):.3f} | {med(1, 'B'):.3f} |",
        f"| bound (the most-read samples held) | {bound:.3f} | | |",
        "",
        f"planned / concatenated once: **{ratio:.2f}x**",
        "",
        "    PYTHONPATH=src .venv/bin/python benchmarks/mixture.py",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)


if __name__ == "__main__":
    main()
