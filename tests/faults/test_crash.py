"""Crash safety: ``kill -9`` at random moments never corrupts, leaks or blocks.

Two series of 20 kills each, at delays drawn from a seeded generator:

* ``mmcache warm`` (and ``mmcache gc --max-size``) filling the disk tier of a
  64-sample dataset under a budget that holds about half of it, so every run puts,
  evicts and, when the budget changes between runs, trims;
* a training loop (``mmcache.DataLoader`` with one worker over a memory tier of
  about a third of the data and a disk tier) that saves ``loader.state_dict()`` and
  the ids and a digest of every batch it consumed after each batch, and resumes from
  that file: runs put, evict, promote disk hits into memory and gather hits.

After every kill: the cache opens at once, ``mmcache verify`` passes (or repairs),
every entry it serves equals an uncached decode, the disk tier's recorded totals
equal the bytes it really holds, the memory tier's invariants hold
(``MemoryStore.check()``), and the batches recorded so far are exactly the
reference run's first batches; at the end the resumed runs have consumed exactly
the reference's batches, each once.

The CLI runs in forked children (``mmcache.cli.main``): the same code as the
``mmcache`` command without paying an interpreter start per kill; one test also
kills a real ``python -m mmcache.cli warm`` process. The loop's child puts itself in
a process group with its DataLoader worker, and the group is killed, as a job
scheduler does; the worker is never left orphaned.
"""

from __future__ import annotations

import contextlib
import glob
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from mmcache import cli
from mmcache.cache import Cache, _memory_name
from mmcache.dataset import MultimodalDataset
from mmcache.loader import DataLoader
from mmcache.stores.disk import DiskStore
from mmcache.stores.memory import MemoryStore, reclaim_orphans, store_dir
from mmcache.transforms import ImageSpec, TextSpec
from mmcache.transforms.pipeline import Pipeline

FORK = mp.get_context("fork")
N = 64
SIZE = 32
MAX_LENGTH = 16
KILLS = 20
SAMPLE_BYTES = 3 * SIZE * SIZE + 2 * 4 * MAX_LENGTH  # payload of one sample, header aside
# The loop: 3 epochs of 8 batches; a "training step" of 15 ms per batch.
EPOCHS, BATCH, STEP = 3, 8, 0.015
LOOP_MEMORY = 24 * 4096  # about a third of the data: evictions every epoch
LOOP_DISK = "1MiB"


@dataclass
class Data:
    manifest: Path
    tokenizer: Path
    pipeline: Pipeline
    refs: dict[bytes, dict[str, np.ndarray]]  # every sample's key -> its uncached arrays


def make_pipeline(tokenizer: str | Path) -> Pipeline:
    # what `mmcache warm --size 32 --max-length 16 --tokenizer T` builds
    return Pipeline(image=ImageSpec(size=SIZE), text=TextSpec(tokenizer, max_length=MAX_LENGTH))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, tokenizer_json: Path) -> Data:
    from mmcache.synth import make_dataset

    manifest = make_dataset(tmp_path_factory.mktemp("crash-data"), N, seed=2, workers=1)
    pipeline = make_pipeline(tokenizer_json)
    ds = MultimodalDataset(manifest, pipeline=pipeline)
    refs = {ds.key(i): ds.produce(i) for i in range(len(ds))}
    return Data(manifest, tokenizer_json, pipeline, refs)


def remove_segments(root: Path) -> list[str]:
    paths = glob.glob(f"{store_dir()}/mmcache-{_memory_name(root.absolute())}*")
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return paths


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "cache"
    yield path
    remove_segments(path)


# ------------------------------------------------------------------------------------------
# children
# ------------------------------------------------------------------------------------------


def run_cli(argv: list[str]) -> None:
    """A forked `mmcache ARGV` (its own process group, like a job)."""
    os.setpgrp()
    sys.exit(cli.main(argv))


def batch_digest(batch: dict[str, Any]) -> str:
    h = xxhash.xxh3_64()
    for name in ("image", "input_ids", "attention_mask"):
        h.update(batch[name].numpy().tobytes())
    return h.hexdigest()


def write_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def make_loader(ds: MultimodalDataset, cache: Cache | None, workers: int) -> DataLoader:
    return DataLoader(ds, cache=cache, batch_size=BATCH, seed=5, num_workers=workers)


def training_loop(manifest: str, tokenizer: str, root: str, progress: str) -> None:
    """Train (sleep) over EPOCHS epochs, resuming from ``progress``; save after each batch."""
    os.setpgrp()  # the DataLoader worker joins this group: killed with it
    ds = MultimodalDataset(manifest, pipeline=make_pipeline(tokenizer))
    cache = Cache(root, memory=LOOP_MEMORY, disk=LOOP_DISK, policy="lru")
    loader = make_loader(ds, cache, workers=1)
    path = Path(progress)
    saved = json.loads(path.read_text()) if path.exists() else {"state": None, "batches": []}
    start = 0
    if saved["state"] is not None:
        loader.load_state_dict(saved["state"])
        start = saved["state"]["epoch"] + (saved["state"]["position"] >= len(loader))
    for epoch in range(start, EPOCHS):
        loader.set_epoch(epoch)  # keeps the restored position in the restored epoch
        for batch in loader:
            time.sleep(STEP)
            saved["batches"].append([loader.epoch, batch["id"], batch_digest(batch)])
            saved["state"] = loader.state_dict()
            write_atomic(path, saved)
    cache.close()


def kill_group(proc: Any) -> bool:
    """SIGKILL the child's process group; return whether it was still running."""
    alive = proc.is_alive()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # exited, or killed before it made its group
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    assert proc.exitcode is not None, "a killed child did not die"
    return alive and proc.exitcode == -signal.SIGKILL


# ------------------------------------------------------------------------------------------
# what must hold after every crash
# ------------------------------------------------------------------------------------------


@dataclass
class Verified:
    entries: int = 0
    repaired: int = 0


def verify_cli(root: Path, capsys: pytest.CaptureFixture[str], out: Verified) -> None:
    """`mmcache verify` passes, or `--repair` fixes it and it passes then."""
    code = cli.main(["verify", "--cache", str(root), "--json"])
    report = json.loads(capsys.readouterr().out)
    if code != 0:
        assert cli.main(["verify", "--cache", str(root), "--repair", "--json"]) == 0
        out.repaired += len(report["bad"])
        capsys.readouterr()
        assert cli.main(["verify", "--cache", str(root), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["ok"]


def check_disk(disk: DiskStore, data: Data) -> int:
    """Recorded totals == the bytes really held <= budget; every entry is one of ours."""
    recorded = (disk.nbytes(), len(disk))
    keys = list(disk.keys())
    held = sum(len(disk.get(k) or b"") for k in keys)
    assert recorded == (held, len(keys)) == disk.rebuild_totals()
    assert held <= disk.capacity()
    assert set(keys) <= set(data.refs), "an entry that no sample of the dataset made"
    return len(keys)


def check_served(cache: Cache, data: Data) -> int:
    """Every entry any tier serves equals the uncached decode (never a torn or bad one)."""
    served = 0
    for key, ref in data.refs.items():
        sample = cache.get(key)
        if sample is None:
            continue
        served += 1
        assert sample.keys() == ref.keys()
        for name, arr in ref.items():
            np.testing.assert_array_equal(sample[name], arr, err_msg=f"{key.hex()} {name}")
    corrupt = sum(t.corrupt for t in cache.stats().tiers.values())
    assert corrupt == 0, "a crash left an entry that failed its checksum"
    return served


def open_quickly(root: Path, **kwargs: Any) -> Cache:
    t0 = time.perf_counter()
    cache = Cache(root, **kwargs)
    # a lock or segment left by the dead process would make this wait (30 s timeout)
    assert time.perf_counter() - t0 < 5, "opening after a crash waited on the dead process"
    return cache


# ------------------------------------------------------------------------------------------
# kill -9 mmcache warm / gc
# ------------------------------------------------------------------------------------------


def warm_argv(data: Data, root: Path, disk: str) -> list[str]:
    return [
        "warm", str(data.manifest), "--cache", str(root), "--workers", "0", "--disk", disk,
        "--policy", "lru", "--size", str(SIZE), "--max-length", str(MAX_LENGTH),
        "--tokenizer", str(data.tokenizer), "--json",
    ]  # fmt: skip


def disk_puts(root: Path) -> int:
    """Puts counted so far by every process (slot 3 of the documented stats.i64 file)."""
    try:
        return int(np.fromfile(root / "disk" / "stats.i64", dtype="<i8", count=4)[3])
    except (OSError, IndexError, ValueError):
        return 0


def wait_until(condition: Any, child: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while child.is_alive() and not condition() and time.monotonic() < deadline:
        time.sleep(0.002)


@pytest.mark.slow
def test_kill_warm_and_gc_at_20_random_moments(
    data: Data, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = np.random.default_rng(20261130)
    seen = Verified()
    kills = 0
    attempts = 0
    while kills < KILLS:
        attempts += 1
        assert attempts < 5 * KILLS, "the children kept finishing before the kill"
        # mostly warm, under a budget that alternates (a trim at open, evictions in the
        # run); every fifth a gc that shrinks the disk tier
        gc = attempts % 5 == 0 and (root / "cache.json").exists()
        if gc:
            argv = ["gc", "--cache", str(root), "--max-size", "64KiB", "--json"]
        else:
            argv = warm_argv(data, root, ("96KiB", "160KiB")[attempts % 2])
        puts = disk_puts(root)
        child = FORK.Process(target=run_cli, args=(argv,))
        child.start()
        if gc or attempts % 2:  # at a random moment: opening, reading, putting...
            time.sleep(rng.uniform(0.0, 0.08) if gc else rng.uniform(0.02, 0.3))
        else:  # after a random number of puts, a few ms into the next ones
            target = puts + int(rng.integers(1, 30))
            wait_until(lambda t=target: disk_puts(root) >= t, child)
            time.sleep(rng.uniform(0.0, 0.01))
        kills += kill_group(child)
        capsys.readouterr()
        if not (root / "cache.json").exists():
            continue  # killed before the cache existed
        verify_cli(root, capsys, seen)
        with open_quickly(root, memory=0, disk="160KiB", policy="lru") as cache:
            assert cache.disk is not None
            check_disk(cache.disk, data)  # type: ignore[arg-type]
            seen.entries += check_served(cache, data)
    # and a last warm run completes from wherever the kills left it
    child = FORK.Process(target=run_cli, args=(warm_argv(data, root, "160KiB"),))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    with open_quickly(root, memory=0, disk="160KiB", policy="lru") as cache:
        assert cache.disk is not None
        assert check_disk(cache.disk, data) == check_served(cache, data) > 0  # type: ignore[arg-type]
    assert seen.repaired == 0, "LMDB commits are atomic: nothing should need repair"
    assert seen.entries > 0


@pytest.mark.slow
def test_kill_the_real_cli_process(data: Data, root: Path) -> None:
    """One kill of a real `python -m mmcache.cli warm` (interpreter and all), mid-run."""
    argv = [sys.executable, "-m", "mmcache.cli", *warm_argv(data, root, "160KiB")]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # wait until it has committed a first entry, then kill it mid-run
        deadline = time.monotonic() + 60
        stats = root / "disk" / "stats.i64"
        while time.monotonic() < deadline and proc.poll() is None:
            if stats.exists() and (root / "cache.json").exists():
                with DiskStore(root / "disk", capacity="160KiB", policy="lru", readonly=True) as d:
                    if len(d) >= 4:
                        break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    code = subprocess.run(
        [sys.executable, "-m", "mmcache.cli", "verify", "--cache", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert code.returncode == 0, code.stdout + code.stderr
    assert " 0 bad" in code.stdout
    with open_quickly(root, memory=0, disk="160KiB", policy="lru") as cache:
        assert cache.disk is not None
        n = check_disk(cache.disk, data)  # type: ignore[arg-type]
        assert 4 <= n == check_served(cache, data)


# ------------------------------------------------------------------------------------------
# kill -9 a training loop
# ------------------------------------------------------------------------------------------


def reference_batches(data: Data) -> list[list[Any]]:
    ds = MultimodalDataset(data.manifest, pipeline=data.pipeline)
    loader = make_loader(ds, None, workers=0)
    out: list[list[Any]] = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        out += [[epoch, b["id"], batch_digest(b)] for b in loader]
    return out


def progress_count(path: Path) -> int:
    try:
        return len(json.loads(path.read_text())["batches"])
    except (OSError, ValueError):
        return 0


def check_progress(path: Path, reference: list[list[Any]]) -> int:
    """The batches consumed so far are exactly the reference's first ones, and the
    saved loader state points right after them."""
    if not path.exists():
        return 0
    saved = json.loads(path.read_text())
    done = saved["batches"]
    assert done == reference[: len(done)], "a resumed loader repeated, skipped or changed a batch"
    per_epoch = len(reference) // EPOCHS
    assert saved["state"]["epoch"] == (len(done) - 1) // per_epoch
    assert saved["state"]["position"] == (len(done) - 1) % per_epoch + 1
    return len(done)


@pytest.mark.slow
def test_kill_a_training_loop_at_20_random_moments(
    data: Data, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = reference_batches(data)
    assert len(reference) == EPOCHS * N // BATCH
    rng = np.random.default_rng(7)
    seen = Verified()
    job = 0
    progress = tmp_path / f"progress-{job}.json"
    kills = attempts = 0
    consumed_at_kill: list[int] = []
    while kills < KILLS:
        attempts += 1
        assert attempts < 5 * KILLS
        args = (str(data.manifest), str(data.tokenizer), str(root), str(progress))
        done = check_progress(progress, reference)
        child = FORK.Process(target=training_loop, args=args)
        child.start()
        if attempts % 2:  # at a random moment: opening, planning, the first batches...
            time.sleep(rng.uniform(0.02, 0.5))
        else:  # a random number of batches later, a few ms into the next one
            target = done + int(rng.integers(1, 6))
            wait_until(lambda t=target, p=progress: progress_count(p) >= t, child)
            time.sleep(rng.uniform(0.0, STEP * 2))
        killed = kill_group(child)
        kills += killed
        if not killed:  # the job finished before the kill: check it, start another
            assert child.exitcode == 0
            assert check_progress(progress, reference) == len(reference)
            job += 1
            progress = tmp_path / f"progress-{job}.json"
            continue
        consumed_at_kill.append(check_progress(progress, reference))
        verify_cli(root, capsys, seen)
        with open_quickly(root, memory=LOOP_MEMORY, disk=LOOP_DISK, policy="lru") as cache:
            assert cache.memory is not None and cache.disk is not None
            assert cache.memory.check() == []  # type: ignore[attr-defined]
            assert cache.memory.nbytes() <= cache.memory.capacity()
            check_disk(cache.disk, data)  # type: ignore[arg-type]
            seen.entries += check_served(cache, data)
    # the last job runs to its end: exactly the reference's batches, each once
    child = FORK.Process(
        target=training_loop,
        args=(str(data.manifest), str(data.tokenizer), str(root), str(progress)),
    )
    child.start()
    child.join(120)
    assert child.exitcode == 0
    assert check_progress(progress, reference) == len(reference)
    assert seen.repaired == 0
    # the kills landed at many different places (not all before the first batch)
    assert len(set(consumed_at_kill)) >= 5, consumed_at_kill


# ------------------------------------------------------------------------------------------
# shared memory and locks of a dead process
# ------------------------------------------------------------------------------------------


def hold_cache(root: str, ready: Any, temporary: bool, in_lock: bool) -> None:
    os.setpgrp()
    cache = Cache(root, memory=256 * 1024, disk=None, temporary=temporary)
    assert cache.memory is not None
    for i in range(16):
        cache.put(i.to_bytes(16, "big"), {"x": np.full(1000, i, dtype=np.int32)})
    if in_lock:
        store: Any = cache.memory
        with store._session.exclusive():  # die inside a critical section, holding the node lock
            ready.set()
            time.sleep(60)
    ready.set()
    time.sleep(60)


@pytest.mark.parametrize(
    ("temporary", "in_lock"),
    [(True, False), (True, True), (False, True)],
    ids=["temporary", "temporary-in-lock", "persistent-in-lock"],
)
def test_a_killed_process_never_blocks_the_next_start(
    root: Path, temporary: bool, in_lock: bool
) -> None:
    """mosaicml/streaming #717/#781: a crashed run's segments and locks must not block
    or break the next run, even with another budget, and are reclaimed."""
    ready = FORK.Event()
    child = FORK.Process(target=hold_cache, args=(str(root), ready, temporary, in_lock))
    child.start()
    assert ready.wait(30)
    assert kill_group(child)
    leftovers = glob.glob(f"{store_dir()}/mmcache-{_memory_name(root.absolute())}*")
    assert leftovers, "the killed process's segments should still be there"
    # the next run opens at once, even asking for another budget, and works
    with open_quickly(root, memory=512 * 1024, disk=None, temporary=temporary) as cache:
        store = cache.memory
        assert isinstance(store, MemoryStore)
        assert store.check() == []
        assert store.capacity() == 512 * 1024  # re-created: nobody alive was attached
        cache.put(bytes(16), {"x": np.arange(10, dtype=np.int32)})
        got = cache.get(bytes(16))
        assert got is not None and got["x"].tolist() == list(range(10))
    left = glob.glob(f"{store_dir()}/mmcache-{_memory_name(root.absolute())}*")
    if temporary:
        assert left == [], "a temporary store is removed when its last user closes"
    else:
        # a persistent store stays for the next run, until its cache root is gone
        assert left
        name = _memory_name(root.absolute())  # (named after the root's identity, gone with it)
        for path in root.rglob("*"):
            if path.is_file():
                path.unlink()
        for path in sorted(root.rglob("*"), reverse=True):
            path.rmdir()
        root.rmdir()
        removed = reclaim_orphans(f"{name}*")
        assert sorted(removed) == sorted(left)


def test_gc_reclaims_segments_of_a_killed_temporary_cache(root: Path, tmp_path: Path) -> None:
    """Nobody reopens the cache: `mmcache gc --all` on any cache removes the dead one's
    segments (a plain gc stays in its own root)."""
    ready = FORK.Event()
    child = FORK.Process(target=hold_cache, args=(str(root), ready, True, False))
    child.start()
    assert ready.wait(30)
    assert kill_group(child)
    dead = sorted(glob.glob(f"{store_dir()}/mmcache-{_memory_name(root.absolute())}*"))
    assert dead
    other = tmp_path / "other"
    with Cache(other, memory=0, disk="1MiB") as cache:
        assert not set(dead) & set(cache.gc().orphan_segments)
        report = cache.gc(all_roots=True)
    assert set(dead) <= set(report.orphan_segments)
    assert glob.glob(f"{store_dir()}/mmcache-{_memory_name(root.absolute())}*") == []


def test_reject_logs_of_killed_processes_do_not_pile_up(tmp_path: Path) -> None:
    """A killed training process leaves its reject log; the next dataset removes it."""
    from mmcache.synth import make_dataset

    manifest = make_dataset(tmp_path / "data", 2, seed=0)
    logs = tmp_path / "tmp"
    logs.mkdir()
    script = (
        "import os, signal, sys\n"
        "from mmcache.dataset import MultimodalDataset\n"
        "from mmcache.defaults import default_pipeline\n"
        "ds = MultimodalDataset(sys.argv[1], pipeline=default_pipeline(size=32, max_length=8))\n"
        "if sys.argv[2] == 'kill':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "TMPDIR": str(logs)}
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", script, str(manifest), "kill"], env=env)
        assert run.returncode == -signal.SIGKILL
        assert len(list(logs.glob("mmcache-rejects-*"))) == 1  # the last killed one's
    run = subprocess.run([sys.executable, "-c", script, str(manifest), "exit"], env=env)
    assert run.returncode == 0
    assert list(logs.glob("mmcache-rejects-*")) == []
