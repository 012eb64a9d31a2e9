"""``scope="cluster"`` under torchrun: two "nodes" on this machine, two ranks each (gloo).

Each node is a ``torchrun --nnodes 2 --node-rank K`` launcher with its own
``MMCACHE_NODE`` (so its own shared-memory tier), started from here; every rank
runs ``cluster_worker.py`` and writes what it saw. The memory budget of a node is
exactly half the data: after the first epoch no sample is decoded anywhere (with
and without persistent workers), every rank's batches are bitwise the
single-process uncached run's, and each node's memory tier holds its half of the
data; what is in flight (other homes' samples, in the in-flight tier) stays within
its bound. When one node's processes die or freeze mid-epoch, the other finishes
with local production.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from mmcache import codec  # noqa: E402
from mmcache.cacheroot import memory_name  # noqa: E402
from mmcache.dataset import MultimodalDataset  # noqa: E402
from mmcache.loader import DataLoader, Distributed  # noqa: E402
from mmcache.stores.memory import store_dir  # noqa: E402
from mmcache.synth import make_dataset  # noqa: E402
from mmcache.transforms import ImageSpec  # noqa: E402
from mmcache.transforms.pipeline import Pipeline  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

N = 192
BATCH = 4
SIZE = 32
EPOCHS = 3
NODES = ("node0", "node1")
WORKER = Path(__file__).with_name("cluster_worker.py")


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("cluster-data"), N, seed=1)


@pytest.fixture(scope="module")
def budget(manifest: Path) -> int:
    """Half the data: half the bytes of all its entries (3,200 B each here)."""
    ds = MultimodalDataset(manifest, pipeline=Pipeline(image=ImageSpec(size=SIZE)))
    sizes = [len(codec.encode(ds.produce(i), ctime=0.0, cost=0.0)) for i in range(N)]
    assert len(set(sizes)) == 1  # so that half the bytes is exactly half the entries
    return sum(sizes) // 2


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """One cache root path for both nodes (as on a shared file system); the shared
    memory of both node names is removed afterwards."""
    path = tmp_path / "cache"
    yield path
    for node in NODES:
        os.environ["MMCACHE_NODE"] = node
        try:
            name = memory_name(path.absolute())
        finally:
            del os.environ["MMCACHE_NODE"]
        for f in glob.glob(f"{store_dir()}/mmcache-{name}*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _digest(batch: dict[str, Any]) -> str:
    h = hashlib.sha1()
    h.update("\n".join(batch["id"]).encode())
    h.update(batch["image"].numpy().tobytes())
    return h.hexdigest()


def _launch(
    manifest: Path, root: Path, out: Path, budget: int, *extra: str, nodes: int = 2,
    per_node: int = 2,
    wait_for: int | None = None, timeout: float = 90.0, batch: int = BATCH,
) -> list[dict[str, Any]]:  # fmt: skip
    """Start ``nodes`` torchrun launchers and return the ranks' results (rank order).

    Stops waiting once ``wait_for`` result files exist (a run where a node dies:
    torchrun's exit barrier would wait for it), then kills every launcher's group.
    """
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    procs = []
    for k in range(nodes):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
            "--nproc-per-node", str(per_node), "--node-rank", str(k),
            "--rdzv-endpoint", f"127.0.0.1:{port}", str(WORKER),
            "--manifest", str(manifest), "--root", str(root), "--budget", str(budget),
            "--batch", str(batch), "--size", str(SIZE), "--epochs", str(EPOCHS),
            "--out", str(out), *extra,
        ]  # fmt: skip
        log = open(out / f"launcher{k}.log", "w")  # noqa: SIM115 - closed below
        procs.append(
            (subprocess.Popen(
                cmd, env={**env, "MMCACHE_NODE": NODES[k]}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            ), log)
        )  # fmt: skip
    want = nodes * per_node if wait_for is None else wait_for
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            done = len(list(out.glob("rank*.json")))
            if done >= want and (
                wait_for is not None or all(p.poll() is not None for p, _ in procs)
            ):
                break
            time.sleep(0.2)
        else:
            logs = "\n".join((out / f"launcher{k}.log").read_text()[-3000:] for k in range(nodes))
            pytest.fail(f"torchrun run did not finish in {timeout:.0f} s:\n{logs}")
    finally:
        for pid in out.glob("pid*"):  # workers run in their own process groups
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid.read_text()), signal.SIGKILL)
        for p, log in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
            log.close()
    return sorted(
        (json.loads(f.read_text()) for f in out.glob("rank*.json")), key=lambda r: r["rank"]
    )


def _reference(manifest: Path, world: int) -> list[list[list[str]]]:
    """Each rank's batch digests per epoch, single process, no cache."""
    ds = MultimodalDataset(manifest, pipeline=Pipeline(image=ImageSpec(size=SIZE)))
    out = []
    for r in range(world):
        loader = DataLoader(
            ds,
            cache=None,
            batch_size=BATCH,
            seed=7,
            distributed=Distributed(rank=r, world_size=world),
        )
        epochs = []
        for e in range(EPOCHS):
            loader.set_epoch(e)
            epochs.append([_digest(b) for b in loader])
        out.append(epochs)
    return out


def _check_zero_decodes(results: list[dict[str, Any]], want: list[list[list[str]]]) -> None:
    assert [r["node"] for r in results] == ["node0", "node0", "node1", "node1"]
    for r in results:
        got = [e["batches"] for e in r["epochs"]]
        assert got == want[r["rank"]]  # bitwise the uncached single-process batches
    assert sum(r["epochs"][0]["misses"] for r in results) == N  # cold: each once
    for e in range(1, EPOCHS):
        assert [r["epochs"][e]["produced"] for r in results] == [0, 0, 0, 0]
        assert [r["epochs"][e]["misses"] for r in results] == [0, 0, 0, 0]  # workers too
    for r in results:  # each node's memory tier: its half of the data, nothing else (the
        # first epoch's last cold samples go home with the next epoch's first window)
        assert [e["memory_items"] for e in r["epochs"][1:]] == [N // 2] * (EPOCHS - 1)
        assert all(e["flight_max"] <= e["flight_bound"] for e in r["epochs"])
    last = results[0]["epochs"][-1]["exchange"]
    assert last["received"] > 0 and last["sent_home"] > 0 and last["peer_failures"] == 0
    assert last["late_batches"] == 0


def test_two_nodes_hold_half_each_and_decode_nothing_after_the_first_epoch(
    manifest: Path, root: Path, tmp_path: Path, budget: int
) -> None:
    results = _launch(manifest, root, tmp_path / "out", budget, "--lockstep")
    _check_zero_decodes(results, _reference(manifest, 4))


def test_nodes_reading_their_own_cp_a_copies_decode_nothing_after_the_first_epoch(
    manifest: Path, root: Path, tmp_path: Path, budget: int
) -> None:
    # G17: each node its own `cp -a` copy (other inodes and ctimes, same relative names,
    # sizes, mtimes and bytes): keys are equal, so the exchange serves every node.
    per_node = _copies(manifest, tmp_path)
    results = _launch(per_node, root, tmp_path / "out", budget, "--lockstep")
    _check_zero_decodes(results, _reference(manifest, 4))
    assert all(r["epochs"][-1]["exchange"]["refused"] == 0 for r in results)
    assert [r["warnings"] for r in results] == [[]] * 4  # nothing to warn of


#: The one warning of entries refused because keys differ between nodes (G17).
KEYS_DIFFER = "refused because their keys differ from this node's keys"


def _copies(manifest: Path, tmp_path: Path) -> Path:
    """A ``cp -a`` copy of the data per node; the ``{node}`` manifest path of the copies."""
    for node in NODES:
        shutil.copytree(manifest.parent, tmp_path / node / "data", copy_function=shutil.copy2)
    return tmp_path / "{node}" / "data" / manifest.name


def test_a_node_whose_copy_has_other_bytes_warns_once_why_entries_are_refused(
    manifest: Path, root: Path, tmp_path: Path, budget: int
) -> None:
    # node1's copy: 32 images swapped pairwise (other bytes under the same names and ids),
    # mtimes restored. Those samples' keys differ between the nodes: each rank that
    # receives one refuses it and says why, once; every rank's batches are its own data's.
    per_node = _copies(manifest, tmp_path)
    images = sorted((tmp_path / "node1" / "data" / "images").iterdir())[:32]
    for a, b in zip(images[::2], images[1::2], strict=True):
        sa, sb = a.stat(), b.stat()
        da, db = a.read_bytes(), b.read_bytes()
        a.write_bytes(db)
        b.write_bytes(da)
        os.utime(a, ns=(sa.st_atime_ns, sa.st_mtime_ns))
        os.utime(b, ns=(sb.st_atime_ns, sb.st_mtime_ns))
    results = _launch(per_node, root, tmp_path / "out", budget, "--lockstep", per_node=1)
    assert [r["node"] for r in results] == list(NODES)
    mine = [_reference(Path(str(per_node).format(node=n)), 2) for n in NODES]
    for r in results:
        assert [e["batches"] for e in r["epochs"]] == mine[r["rank"]][r["rank"]]
        assert r["epochs"][-1]["exchange"]["refused"] > 0
        warned = [w for w in r["warnings"] if KEYS_DIFFER in w]
        assert len(warned) == 1, r["warnings"]
        assert "the nodes read other bytes" in warned[0]


def test_a_copy_with_other_relative_names_but_the_same_bytes_shares_every_entry(
    manifest: Path, root: Path, tmp_path: Path, budget: int
) -> None:
    # node1's copy keeps its images under another folder name (the manifest says so): the
    # identity of a sample is its id, caption and bytes, not where the file lies, so the
    # keys are equal, nothing is refused and nothing is warned of.
    per_node = _copies(manifest, tmp_path)
    data1 = tmp_path / "node1" / "data"
    (data1 / "images").rename(data1 / "pictures")
    lines = (data1 / manifest.name).read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    for row in rows:
        row["image_path"] = row["image_path"].replace("images/", "pictures/")
    (data1 / manifest.name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    results = _launch(per_node, root, tmp_path / "out", budget, "--lockstep", per_node=1)
    want = _reference(manifest, 2)
    for r in results:
        assert [e["batches"] for e in r["epochs"]] == want[r["rank"]]
        assert r["epochs"][-1]["exchange"]["refused"] == 0
        assert [e["produced"] for e in r["epochs"][1:]] == [0] * (EPOCHS - 1)
        assert r["warnings"] == []


def test_with_persistent_workers_nothing_is_decoded_after_the_first_epoch_either(
    manifest: Path, root: Path, tmp_path: Path, budget: int
) -> None:
    results = _launch(
        manifest, root, tmp_path / "out", budget, "--lockstep", "--workers", "2", "--persistent"
    )
    _check_zero_decodes(results, _reference(manifest, 4))


def test_a_node_that_dies_mid_epoch_leaves_the_other_to_finish_with_local_production(
    manifest: Path, root: Path, tmp_path: Path, budget: int
) -> None:
    # node1's first rank is killed, its second frozen (a silent peer: its connections
    # stay open), both before batch 1 of epoch 1; node0 times out on it (4 s) and goes on.
    results = _launch(
        manifest, root, tmp_path / "out", budget, "--kill-node", "node1", "--kill-at", "1:1",
        "--timeout", "4", wait_for=2,
    )  # fmt: skip
    want = _reference(manifest, 4)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert [e["batches"] for e in r["epochs"]] == want[r["rank"]]  # every epoch finished
        ex = r["epochs"][-1]["exchange"]
        assert sorted(ex["dead_peers"]) == [2, 3] and ex["peer_failures"] == 2
        # node1's share of what this rank reads after the failure is produced here
        assert sum(e["produced"] for e in r["epochs"][1:]) > 0


def test_stopped_at_40_percent_with_4_ranks_resumed_with_2_gives_exactly_the_rest(
    manifest: Path, root: Path, tmp_path: Path, budget: int
) -> None:
    # 192 samples, 4 ranks, batches of 4: 5 batches each is 80 samples (42%).
    stopped = _launch(manifest, root, tmp_path / "stop", budget, "--stop-at", "0:5")
    states = [r["state"] for r in stopped]
    assert {s["consumed"] for s in states} == {80} and {s["world_size"] for s in states} == {4}
    (tmp_path / "state.json").write_text(json.dumps(states[0]))
    resumed = _launch(
        manifest, root, tmp_path / "resume", budget, "--resume", str(tmp_path / "state.json"),
        "--epochs", "1", nodes=1,
    )  # fmt: skip
    ds = MultimodalDataset(manifest, pipeline=Pipeline(image=ImageSpec(size=SIZE)))
    alone = DataLoader(ds, cache=None, batch_size=BATCH, seed=7)
    alone.set_epoch(0)
    whole = [i for b in alone for i in b["id"]]
    before = sorted(i for r in stopped for i in r["epochs"][0]["ids"])
    after = [r["epochs"][0]["ids"] for r in resumed]
    assert before == sorted(whole[:80])
    assert len(after) == 2 and len(after[0]) == len(after[1]) == 56  # 112 left, 56 each
    assert sorted(after[0] + after[1]) == sorted(whole[80:])
