"""The loader's child processes: they die with the training process, and a stopped one
costs a bounded wait that is said (issue 37: H3, H10).

- ``kill -9`` of a training process (crop processes, the stat prefetcher, two
  persistent workers) at a cold and at a warm epoch: within a few seconds none of its
  children runs, and no ``/dev/shm`` buffer stays mapped (run in a private ``/dev/shm``
  where one can be had, so its space can be accounted for exactly). Before, the crop
  processes blocked in their queue's ``get`` for ever and the workers in joining their
  queue's feeder thread, each holding mapped batch buffers.
- A crop process forked by a thread that then ends lives on while the process does
  (``PR_SET_PDEATHSIG`` follows the forking thread, so it is only asked for from the
  main thread), and ends with the process.
- A crop process stopped with ``SIGSTOP`` and never resumed: the batch waits about a
  second, one warning names the pid, the batches are those of an uncached run. Before,
  the wait was 60 s, with nothing logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from loader_jobs import running
from shm_namespace import private_shm_problem, run_job

from mmcache.augment import Compose, RandomHorizontalFlip, RandomResizedCrop
from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.loader.augmenting import AugmentHook
from mmcache.synth import make_dataset
from mmcache.transforms import ImageSpec
from mmcache.transforms.pipeline import Pipeline

AUG = Compose([RandomResizedCrop(48, scale=(0.3, 1.0)), RandomHorizontalFlip()])


@pytest.mark.parametrize(
    ("epoch", "how"),
    [
        (0, ()),
        (2, ()),
        # No memory tier, 128 px and a slow step: the workers' samples pile up in their
        # result pipe, and an orphan's exit blocks joining its queue's feeder thread.
        (0, ("0", "128", "0.5")),
    ],
    ids=["cold", "warm", "samples-in-pipes"],
)
def test_kill_9_of_the_training_process_ends_its_children(
    epoch: int, how: tuple[str, ...], tmp_path: Path
) -> None:
    private = private_shm_problem() is None
    data, scratch = tmp_path / "data", tmp_path / "scratch"
    scratch.mkdir()
    result = run_job(
        "orphans", str(data), str(scratch), str(epoch), *how, shm=64 << 20 if private else None
    )
    # two crop processes, two workers, the stat prefetcher
    assert result["children"] >= 5, result
    assert result["alive"] == [], f"children still running after the kill: {result}"
    if private:  # this /dev/shm is the job's alone: every byte in use is a file's
        assert result["mapped_while_running"] > 0, result  # (what the check can see)
        assert result["leaked"] == 0, f"/dev/shm still mapped after the kill: {result}"


_FORKED_BY_A_THREAD = """
import threading, time
from mmcache.augment import RandomResizedCrop
from mmcache.loader.croppool import CropPool
pools = []


def fork():
    pools.append(CropPool(RandomResizedCrop(8), 1))
    time.sleep(0.5)  # the child holds its lifeline meanwhile


forker = threading.Thread(target=fork)
forker.start()
forker.join()  # the thread that forked is gone; the process lives on
time.sleep(1.0)
print(pools[0]._procs[0].pid, flush=True)
time.sleep(120)
"""


def test_a_child_forked_by_a_thread_outlives_it_but_not_the_process() -> None:
    """PR_SET_PDEATHSIG follows the thread that forked: a crop process (or worker) forked
    by the loader's assembling thread must not die with that thread, only with the
    process (noticed by its watch thread)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen(
        [sys.executable, "-c", _FORKED_BY_A_THREAD], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        assert running(child), "the crop process died with the thread that forked it"
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5.0
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    outlived = running(child)
    if outlived:
        child.kill()
    assert not outlived, "the crop process outlived the training process"


# -- a stopped crop process --------------------------------------------------------------


@pytest.fixture
def ds(tmp_path: Path) -> MultimodalDataset:
    manifest = make_dataset(tmp_path / "data", 32, seed=4)
    return MultimodalDataset(manifest, pipeline=Pipeline(image=ImageSpec(size=64)))


def _epoch(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return [{"id": b["id"], "image": b["image"].clone()} for b in loader]


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [b["id"] for b in got] == [b["id"] for b in want]
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x["image"], y["image"])


def test_a_stopped_crop_process_is_named_and_the_batch_cropped_here(
    ds: MultimodalDataset, cache_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reference = DataLoader(ds, cache=None, batch_size=8, seed=5, augment=AUG)
    want = [_epoch(reference, e) for e in range(2)]
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(ds, cache=cache, batch_size=8, seed=5, num_workers=2, augment=AUG)
        _same(_epoch(loader, 0), want[0])
        hook = next(h for h in loader._hooks_closing if isinstance(h, AugmentHook))
        crops = hook._crops
        assert crops is not None and crops.processes == 2
        stopped = crops._procs[1].pid
        os.kill(stopped, signal.SIGSTOP)
        try:
            caplog.set_level(logging.WARNING, logger="mmcache")
            began = time.monotonic()
            _same(_epoch(loader, 1), want[1])
            took = time.monotonic() - began
        finally:
            with contextlib.suppress(ProcessLookupError):  # the pool killed it (fixed)
                os.kill(stopped, signal.SIGKILL)
            loader.close()
    warned = [r.getMessage() for r in caplog.records if "crop process" in r.getMessage()]
    assert len(warned) == 1, warned
    assert str(stopped) in warned[0] and "stopped" in warned[0]
    assert took < 10, f"a stopped crop process cost {took:.1f} s"
