"""A cache root removed (``rm -rf ROOT``) and made again at the same path starts cold.

The memory tier lives in ``/dev/shm`` and outlives its processes; it used to be named
from the root's path alone, so a new root at a removed root's path adopted the old
tier and served its entries (issue 37, item 12: a "cold" run that was warm). The tier
is now named after the root's identity too (``ROOT/root-id``, a random number made
with the root), and the store records that identity: the old tier is never attached,
and is reclaimed once nobody uses it (at the root's next open, or by ``gc``).
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
from multiprocessing.synchronize import Barrier
from pathlib import Path

import numpy as np
import pytest

from mmcache.cache import Cache
from mmcache.cacheroot import memory_name
from mmcache.rootfiles import ROOT_ID_FILE
from mmcache.stores.memory import MemoryStore, store_dir, unlink_store

N = 12

# A job of its own process, as a training run is: it opens the root and, with "warm",
# runs a loader epoch over N synthetic samples (writing them to the memory tier), or with
# "count", counts the epoch's hits; it prints its memory tier's name and the epoch's
# hits and misses, one line. With "hold", it then waits for a line on stdin first.
JOB = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from mmcache import Cache, DataLoader, MultimodalDataset
    from mmcache.transforms import ImageSpec
    from mmcache.transforms.pipeline import Pipeline
    data, root, hold = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "hold"
    ds = MultimodalDataset(data / "manifest.jsonl", pipeline=Pipeline(image=ImageSpec(size=32)))
    cache = Cache(root, memory="4MiB", disk=None)
    loader = DataLoader(ds, cache=cache, batch_size=4, num_workers=0)
    list(loader)
    epoch = loader.stats().epochs[0]
    print(cache.memory_name, epoch.hits, epoch.misses, flush=True)
    if hold:
        sys.stdin.readline()
        loader.set_epoch(1)
        list(loader)  # the old root's own entries, still served to its own job
        print(loader.stats().epochs[1].hits, flush=True)
    """
)


def tier_files(name: str) -> list[str]:
    return glob.glob(f"{store_dir()}/mmcache-{glob.escape(name)}*")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmcache.synth import make_dataset

    out = tmp_path_factory.mktemp("identity-data")
    make_dataset(out, N, seed=4)
    return out


def _run(data: Path, root: Path) -> tuple[str, int, int]:
    proc = subprocess.run(
        [sys.executable, "-c", JOB, str(data), str(root), "once"],
        capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    name, hits, misses = proc.stdout.split()
    return name, int(hits), int(misses)


def test_a_root_removed_and_made_again_starts_cold_and_its_old_tier_goes(
    data: Path, tmp_path: Path
) -> None:
    root = tmp_path / "cache"
    first, hits, misses = _run(data, root)
    assert (hits, misses) == (0, N)
    again, hits, misses = _run(data, root)
    assert (again, hits, misses) == (first, N, 0)  # the same root: warm
    assert tier_files(first)
    shutil.rmtree(root)  # what a user does to time a cold epoch
    new, hits, misses = _run(data, root)
    try:
        assert (hits, misses) == (0, N)  # was (N, 0): the removed root's tier adopted
        assert new != first
        assert tier_files(first) == []  # nobody used it: reclaimed at the root's next open
    finally:
        unlink_store(first)
        unlink_store(new)


def test_the_tier_of_a_removed_root_still_in_use_is_kept_for_its_job_then_reclaimed(
    data: Path, tmp_path: Path
) -> None:
    """A job still runs on the removed root: it keeps its tier (its own entries still
    served to it); the new root gets another, cold; ``gc`` reclaims the old one once
    that job has ended."""
    root = tmp_path / "cache"
    old_job = subprocess.Popen(
        [sys.executable, "-c", JOB, str(data), str(root), "hold"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert old_job.stdin is not None and old_job.stdout is not None
    old = ""
    try:
        old = old_job.stdout.readline().split()[0]
        shutil.rmtree(root)
        with Cache(root, memory="4MiB", disk=None) as cache:
            assert cache.memory_name != old
            assert cache.memory is not None and len(cache.memory) == 0
            assert tier_files(old)  # in use: not reclaimed under its job
            old_job.stdin.write("\n")
            old_job.stdin.flush()
            assert int(old_job.stdout.readline()) == N  # its job's own entries, unharmed
            assert old_job.wait(120) == 0
            removed = cache.gc().orphan_segments
            assert tier_files(old) == []
            assert set(removed) >= {f"{store_dir()}/mmcache-{old}.lock"}
            assert tier_files(cache.memory_name)  # its own: kept
            unlink_store(cache.memory_name)
    finally:
        if old_job.poll() is None:
            old_job.kill()
            old_job.wait()
        if old:
            unlink_store(old)


def test_a_root_made_before_identities_gets_one_once_and_its_old_tier_is_reclaimed(
    tmp_path: Path,
) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    legacy = memory_name(root, 0)  # what older releases named the root's memory tier
    old = MemoryStore(legacy, capacity=1 << 20, owner_path=str(root))
    old.put(bytes(16), b"from before")
    old.close()
    try:
        with Cache(root, memory="1MiB", disk=None) as cache:
            made = (root / ROOT_ID_FILE).read_text()
            assert cache.root_id == int(made, 16) > 0
            assert cache.memory_name == memory_name(root) != legacy
            assert cache.get(bytes(16)) is None
            assert tier_files(legacy) == []  # nobody attached: reclaimed at open
        with Cache(root, memory="1MiB", disk=None) as cache:  # made once, kept
            assert (root / ROOT_ID_FILE).read_text() == made
            unlink_store(cache.memory_name)
    finally:
        unlink_store(legacy)


def _open_and_name(root: str, barrier: Barrier, names: mp.Queue[str]) -> None:
    barrier.wait(60)
    with Cache(root, memory="1MiB", disk="1MiB") as cache:
        names.put(cache.memory_name)


def test_processes_opening_a_new_root_at_once_agree_on_its_identity(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_open_and_name, args=(str(root), barrier, out)) for _ in range(6)]
    for p in procs:
        p.start()
    names = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    try:
        assert [p.exitcode for p in procs] == [0] * 6
        assert len(set(names)) == 1
        assert sorted(p.name for p in root.iterdir() if p.is_file()) == [
            "cache.json",
            ROOT_ID_FILE,
        ]  # one identity, no temp file left
    finally:
        unlink_store(names[0])


def test_a_pickled_cache_keeps_the_identity_its_root_had(tmp_path: Path) -> None:
    """A worker unpickling the cache attaches its parent's memory tier, even if the root
    was removed and made again meanwhile (the parent still uses that tier)."""
    root = tmp_path / "cache"
    with Cache(root, memory="1MiB", disk=None) as cache:
        cache.put(bytes(16), {"x": np.arange(3)})
        state = pickle.dumps(cache)
        shutil.rmtree(root)
        with Cache(root, memory="1MiB", disk=None) as other:
            assert other.root_id != cache.root_id
            unlink_store(other.memory_name)
        twin = pickle.loads(state)
        try:
            assert twin.memory_name == cache.memory_name
            got = twin.get(bytes(16))
            assert got is not None and got["x"].tolist() == [0, 1, 2]
        finally:
            twin.close()
        unlink_store(cache.memory_name)


@pytest.mark.parametrize("planted", ["fifo", "symlink", "garbage"])
def test_a_planted_root_id_never_hangs_the_open(
    tmp_path: Path, planted: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A member of a shared root can put anything at ``root-id``: the root opens (no
    wait on a FIFO), warns naming the file, and names its tier from the path alone."""
    root = tmp_path / "cache"
    root.mkdir()
    path = root / ROOT_ID_FILE
    if planted == "fifo":
        os.mkfifo(path)
    elif planted == "symlink":
        (tmp_path / "elsewhere").write_text(f"{1:016x}\n")
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.write_text("not an identity")
    with caplog.at_level("WARNING", logger="mmcache.cacheroot"):
        cache = Cache(root, memory="1MiB", disk=None)
    try:
        assert cache.root_id == 0
        assert cache.memory_name == memory_name(root, 0)
        assert str(path) in caplog.text
    finally:
        unlink_store(cache.memory_name)
        cache.close()


def test_a_shared_roots_identity_is_readable_by_its_group(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    with Cache(root, memory="1MiB", disk=None, mode=0o660) as cache:
        assert (root / ROOT_ID_FILE).stat().st_mode & 0o777 == 0o660
        unlink_store(cache.memory_name, group=os.getegid())
    with Cache(root, memory="1MiB", disk=None) as cache:
        assert (root / ROOT_ID_FILE).stat().st_mode & 0o777 == 0o660  # written once
        unlink_store(cache.memory_name)
