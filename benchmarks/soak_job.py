"""One training process of the soak (``benchmarks/soak.py``), and what it shares with it.

A :class:`JobSpec` says everything a run needs (the data, the cache, the job's seed
and crops); :func:`reference` computes the digest of every batch of an uncached run;
this file, run as a script with a spec (JSON) as its argument, is one run of a job:

* ``train``: the documented loop (``for e in range(start, N): loader.set_epoch(e);
  for batch in loader: ...``) resumed from ``spec.state`` when it exists, logging
  ``epoch position digest`` after each batch, then saving ``[epoch, state_dict()]``
  atomically, so a ``kill -9`` at any moment resumes exactly (a batch logged but not
  saved is replayed and logged again, with the same digest);
* ``warm``: one epoch through the cache after the soak, printing its hits and
  misses (JSON) and logging its batches like ``train``.

An exception is written to ``spec.crash`` as a signature (its type and the innermost
frame in mmcache, or the innermost at all) and the run exits 3; resuming that failed
exits 4. The soak tells apart runs it killed, runs that crashed and runs that
finished from that and the exit status.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from mmcache.augment import RandomResizedCrop
from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.transforms import ImageSpec, TextSpec
from mmcache.transforms.pipeline import Pipeline

IMAGE_SIZE, CROP_SIZE, MAX_LENGTH = 32, 24, 16
CRASHED, RESUME_FAILED = 3, 4  # exit statuses of a run that raised


@dataclass(frozen=True)
class JobSpec:
    """One job of the soak: its order (``seed``), its crops and the files of its runs."""

    job: int
    seed: int
    crops: bool  # random crops after the cache, by crop processes (workers > 0)
    manifest: str
    tokenizer: str
    root: str
    memory: str
    disk: str
    epochs: int
    batch_size: int
    workers: int
    step_s: float  # the "training step": a sleep after each batch
    state: str  # [epoch, state_dict()] after the last batch saved
    log: str  # one line per batch: epoch position digest
    crash: str  # the signature of an exception that ended the run

    def with_files(self, folder: Path, name: str) -> JobSpec:
        """The same job, with this run's log and crash files in ``folder``."""
        return dataclasses.replace(
            self, log=str(folder / f"{name}.log"), crash=str(folder / f"{name}.crash")
        )


def make_loader(spec: JobSpec, dataset: MultimodalDataset, cache: Cache | None) -> DataLoader:
    return DataLoader(
        dataset,
        cache=cache,
        batch_size=spec.batch_size,
        seed=spec.seed,
        num_workers=spec.workers if cache is not None else 0,
        augment=RandomResizedCrop(CROP_SIZE) if spec.crops else None,
    )


def pipeline(spec: JobSpec) -> Pipeline:
    return Pipeline(
        image=ImageSpec(size=IMAGE_SIZE), text=TextSpec(spec.tokenizer, max_length=MAX_LENGTH)
    )


def digest(batch: dict[str, Any]) -> str:
    """The bytes of every tensor of a batch, and its ids, as one xxh3 digest."""
    h = xxhash.xxh3_64()
    h.update("\n".join(batch["id"]).encode())
    for name in ("image", "input_ids", "attention_mask"):
        h.update(batch[name].contiguous().numpy().tobytes())
    return h.hexdigest()


class _Decoded(MultimodalDataset):
    """The dataset with each sample decoded once (no mmcache cache): the reference
    runs of three jobs over many epochs then cost one decode per sample. Copies, so
    nothing downstream can change the kept arrays."""

    def __init__(self, manifest: str, pipeline: Pipeline) -> None:
        super().__init__(manifest, pipeline=pipeline)
        self._decoded: dict[int, dict[str, Any]] = {}

    def produce(self, index: int) -> dict[str, Any]:
        if index not in self._decoded:
            self._decoded[index] = super().produce(index)
        return {k: v.copy() for k, v in self._decoded[index].items()}


def reference(specs: list[JobSpec]) -> list[dict[tuple[int, int], str]]:
    """Each job's ``{(epoch, position): digest}`` over its epochs, uncached, in this
    process (crops here, not in crop processes: the loader promises the same bytes)."""
    dataset = _Decoded(specs[0].manifest, pipeline(specs[0]))
    out = []
    for spec in specs:
        loader = make_loader(spec, dataset, None)
        want = {}
        for epoch in range(spec.epochs):
            loader.set_epoch(epoch)
            for position, batch in enumerate(loader, 1):
                want[(epoch, position)] = digest(batch)
        out.append(want)
    return out


def _save(path: str, obj: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def _signature(exc: BaseException) -> str:
    """``Type @ mmcache/path.py:line function`` of the innermost frame in mmcache."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/mmcache/" in f.filename] or frames
    if not ours:
        return type(exc).__name__
    f = ours[-1]
    where = f.filename.split("/mmcache/", 1)[-1] if "/mmcache/" in f.filename else f.filename
    return f"{type(exc).__name__} @ {where}:{f.lineno} {f.name}"


def train(spec: JobSpec) -> int:
    dataset = MultimodalDataset(spec.manifest, pipeline=pipeline(spec))
    with Cache(spec.root, memory=spec.memory, disk=spec.disk, fallback="uncached") as cache:
        loader = make_loader(spec, dataset, cache)
        start = 0
        if os.path.exists(spec.state):
            try:
                with open(spec.state) as fh:
                    start, state = json.load(fh)
                loader.load_state_dict(state)
            except Exception as exc:
                _write_crash(spec, exc, "resume")
                return RESUME_FAILED
        with open(spec.log, "a", buffering=1) as log:
            for epoch in range(start, spec.epochs):
                loader.set_epoch(epoch)
                for batch in loader:
                    time.sleep(spec.step_s)
                    state = loader.state_dict()
                    log.write(f"{epoch} {state['position']} {digest(batch)}\n")
                    _save(spec.state, [epoch, state])
        loader.close()
    return 0


def warm(spec: JobSpec) -> int:
    """One epoch (epoch 0) through the cache; its hits and misses as JSON on stdout."""
    dataset = MultimodalDataset(spec.manifest, pipeline=pipeline(spec))
    with Cache(spec.root, memory=spec.memory, disk=spec.disk, fallback="uncached") as cache:
        loader = make_loader(spec, dataset, cache)
        loader.set_epoch(0)
        with open(spec.log, "a", buffering=1) as log:
            for batch in loader:
                log.write(f"0 {loader.state_dict()['position']} {digest(batch)}\n")
        stats = loader.stats()
        loader.close()
    print(json.dumps({"hits": stats.hits, "misses": stats.misses, "tiers": stats.tier_hits}))
    return 0


def _write_crash(spec: JobSpec, exc: BaseException, phase: str) -> None:
    traceback.print_exception(exc)
    message = str(exc).splitlines()[0][:300] if str(exc) else ""
    _save(spec.crash, {"signature": _signature(exc), "message": message, "phase": phase})


def main(argv: list[str]) -> int:
    mode, spec = argv[0], JobSpec(**json.loads(argv[1]))
    try:
        return train(spec) if mode == "train" else warm(spec)
    except BaseException as exc:  # every way a run can fail is one line of the report
        _write_crash(spec, exc, mode)
        return CRASHED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
