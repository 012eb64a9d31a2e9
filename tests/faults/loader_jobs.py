"""Training jobs the loader's process and /dev/shm fault tests run as processes of their own.

``python loader_jobs.py COMMAND ARGS``; each command prints one JSON line last:

- ``train DATA ROOT MARKER MEMORY SIZE STEP``: a training loop over epochs without
  end (crop processes, two persistent workers, a cache of MEMORY bytes, SIZE px
  images, STEP seconds a batch), appending ``epoch`` to MARKER at the fourth batch of
  each epoch: what the kill -9 tests kill;
- ``orphans DATA SCRATCH EPOCH [MEMORY SIZE STEP]``: starts ``train``, kills it with
  SIGKILL once it is at EPOCH (0: cold, 2: warm), then reports its children still
  running after ``SETTLE_S`` seconds and the bytes of ``/dev/shm`` no file holds
  (buffers still mapped by some process: zero once every child is gone);
- ``job DATA ROOT MEMORY SIZE``: one job: the uncached batches of two epochs (crops
  in this process), then the same two epochs through a cache of ``MEMORY`` (bytes,
  or ``auto``) with two workers and crop processes, images of ``SIZE`` px; reports
  whether they were equal and the loader's warnings;
- ``jobs DATA SCRATCH N MEMORY SIZE SAMPLES``: N ``job`` commands at once, each on its
  own root, over one dataset of SAMPLES images;
- ``full DATA SCRATCH FREE``: fills ``/dev/shm`` until FREE bytes are left, then runs
  ``job`` with ``memory="1MiB"`` and crops of 224 px, whose output batches alone need
  more than FREE (at most 1 MiB): some piece is certain to find no room.

The /dev/shm commands are meant for a private mount namespace with a small tmpfs on
``/dev/shm`` (``unshare -m``, see ``test_loader_processes.py``): they fill it.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from mmcache.augment import Compose, RandomHorizontalFlip, RandomResizedCrop
from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.synth import make_dataset
from mmcache.transforms import ImageSpec
from mmcache.transforms.pipeline import Pipeline

AUG = Compose([RandomResizedCrop(48, scale=(0.3, 1.0)), RandomHorizontalFlip()])
#: The ``full`` command's crops: one output batch of them (8 x 3 x 224 x 224 bytes at
#: least, 1.15 MiB) is more than the most it leaves free, so a shortage is certain
#: whichever of the loader's pieces and the memory tier's pages take the room first.
FULL_AUG = Compose([RandomResizedCrop(224, scale=(0.3, 1.0)), RandomHorizontalFlip()])
SAMPLES = 48
BATCH = 8
#: Seconds after the kill within which every child must be gone.
SETTLE_S = 5.0


def dataset(data: str, size: int = 64, samples: int = SAMPLES) -> MultimodalDataset:
    manifest = Path(data) / "manifest.jsonl"
    if not manifest.exists():
        make_dataset(data, samples, seed=4)
    return MultimodalDataset(manifest, pipeline=Pipeline(image=ImageSpec(size=size)))


def loader(ds: MultimodalDataset, cache: Cache | None, aug: Compose = AUG, **kw: Any) -> DataLoader:
    return DataLoader(ds, cache=cache, batch_size=BATCH, seed=5, augment=aug, **kw)


def train(data: str, root: str, marker: str, how: list[str]) -> None:
    memory, size, step = how
    ds = dataset(data, int(size))
    cache = Cache(root, memory=int(memory), disk="64MiB", temporary=True)
    run = loader(ds, cache, num_workers=2, persistent_workers=True)
    epoch = 0
    while True:
        run.set_epoch(epoch)
        for i, _ in enumerate(run):
            if i == 3:
                with open(marker, "a") as f:
                    f.write(f"{epoch}\n")
            time.sleep(float(step))
        epoch += 1


def shm_unaccounted() -> int:
    """Bytes of /dev/shm in use that no file there holds: deleted files some process
    still maps or holds open (torch's batch buffers, queue semaphores)."""
    st = os.statvfs("/dev/shm")
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    held = 0
    for path in glob.glob("/dev/shm/**", recursive=True):
        with contextlib.suppress(OSError):
            held += os.lstat(path).st_blocks * 512
    return used - held


def orphans(data: str, scratch: str, epoch: int, how: list[str]) -> dict[str, Any]:
    marker = os.path.join(scratch, "marker")
    before = shm_unaccounted()
    root = os.path.join(scratch, "root")
    child = subprocess.Popen([sys.executable, __file__, "train", data, root, marker, *how])
    deadline = time.monotonic() + 120
    while not os.path.exists(marker) or len(Path(marker).read_text().split()) <= epoch:
        if child.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the training process ended or never reached epoch {epoch}")
        time.sleep(0.05)
    kids = psutil.Process(child.pid).children(recursive=True)
    mapped = shm_unaccounted() - before
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    killed = time.monotonic()
    alive = kids
    while alive and time.monotonic() - killed < SETTLE_S:
        time.sleep(0.1)
        alive = [k for k in kids if running(k)]
    gone_s = time.monotonic() - killed
    left = [{"pid": k.pid, "name": _name(k)} for k in alive]
    leaked = shm_unaccounted() - before
    for k in alive:  # never leave them behind, whatever the outcome
        k.kill()
    return {
        "children": len(kids),
        "alive": left,
        "gone_s": round(gone_s, 2),
        "mapped_while_running": mapped,
        "leaked": leaked,
    }


def running(p: psutil.Process) -> bool:
    """Whether ``p`` runs (a zombie does not: it waits for its parent to reap it)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("mmcache.loader"):
            self.messages.append(record.getMessage())


def _batches(run: DataLoader, epochs: int) -> list[dict[str, Any]]:
    out = []
    for e in range(epochs):
        run.set_epoch(e)
        out.extend(
            {"id": list(b["id"]), "image": b["image"].clone(), "key": list(b["key"])} for b in run
        )
    return out


def _meet(barrier: str, n: int, timeout: float = 240.0) -> None:
    """Wait until ``n`` jobs have each made a file in ``barrier``: the jobs' caches are
    then all open at once, whatever the machine's load did to their start-up times."""
    Path(barrier, str(os.getpid())).touch()
    deadline = time.monotonic() + timeout
    while len(os.listdir(barrier)) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {len(os.listdir(barrier))} of {n} jobs met in {timeout} s")
        time.sleep(0.05)


def job(
    data: str, root: str, memory: str, size: str = "64", meet: str = "", *, aug: Compose = AUG
) -> dict[str, Any]:
    """One job; ``meet``, ``"FOLDER:N"``: wait, once its cache is open, for N jobs."""
    ds = dataset(data, int(size))
    want = _batches(loader(ds, None, aug), 2)
    warnings = _Warnings()
    logging.getLogger("mmcache").addHandler(warnings)
    size: int | str = memory if memory == "auto" else int(memory)
    with Cache(root, memory=size, temporary=True, fallback="uncached") as cache:
        if meet:  # every job sized and opened its tier before any trains or closes
            barrier, n = meet.rsplit(":", 1)
            _meet(barrier, int(n))
        run = loader(ds, cache, aug, num_workers=2, persistent_workers=True)
        got = _batches(run, 2)
        budget = cache.memory_budget
        run.close()
    same = len(got) == len(want) and all(
        g["id"] == w["id"] and torch.equal(g["image"], w["image"])
        for g, w in zip(got, want, strict=True)
    )
    return {"same": same, "batches": len(got), "budget": budget, "warnings": warnings.messages}


def torch_files() -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob("/dev/shm/torch_*"))


def jobs(
    data: str, scratch: str, n: int, *, memory: str, size: str, samples: int
) -> dict[str, Any]:
    dataset(data, samples=samples)  # made once, before the jobs start together
    barrier = os.path.join(scratch, "opened")
    os.makedirs(barrier, exist_ok=True)
    job_args = [memory, size, f"{barrier}:{n}"]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "job", data, os.path.join(scratch, f"root{i}"), *job_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        lines = out.strip().splitlines()
        result = json.loads(lines[-1]) if p.returncode == 0 and lines else {}
        results.append({"rc": p.returncode, **result, "stderr": err[-2000:]})
    return {"jobs": results, "torch_files": torch_files()}


def full(data: str, scratch: str, free: int) -> dict[str, Any]:
    dataset(data)
    fill = "/dev/shm/other-program"
    fd = os.open(fill, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        st = os.statvfs("/dev/shm")
        os.posix_fallocate(fd, 0, max(st.f_bavail * st.f_frsize - free, 0))
        result = job(data, os.path.join(scratch, "root"), str(1 << 20), aug=FULL_AUG)
        result["torch_files"] = torch_files()
        return result
    finally:
        os.close(fd)
        os.unlink(fill)


def main(argv: list[str]) -> None:
    command, args = argv[0], argv[1:]
    if command == "train":
        train(args[0], args[1], args[2], args[3:])
        return
    if command == "orphans":
        result = orphans(args[0], args[1], int(args[2]), args[3:] or [str(16 << 20), "64", "0.02"])
    elif command == "job":
        result = job(*args)
    elif command == "jobs":
        memory, size, samples = args[3], args[4], int(args[5])
        result = jobs(args[0], args[1], int(args[2]), memory=memory, size=size, samples=samples)
    elif command == "full":
        result = full(args[0], args[1], int(args[2]))
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
