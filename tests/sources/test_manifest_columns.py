"""A manifest's columns built once per node and mapped by every process (issue 41).

:mod:`mmcache.sources.nodecolumns`: the first read of a manifest parses it and writes a
column file; every later read, in any process, maps that file instead of parsing; a
rewritten manifest gets new columns; a damaged, foreign, linked or not-private file is
refused and built again; the heap a read leaves holds nothing per record.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import mmcache
from mmcache.sources import readers
from mmcache.sources.records import Records

#: Run in another process: read the manifest with the JSONL reader counted, and print the
#: parse count, the first ids and whether the column file is mapped there.
_CHILD = """
import json, sys
from mmcache.sources import readers
calls = [0]
real = readers._READERS["jsonl"]
def counted(f, builder):
    calls[0] += 1
    real.read(f, builder)
readers._READERS["jsonl"] = readers._Registered(counted, real.unit)
if len(sys.argv) > 2:  # wait for the go, so that the children read at one moment
    import os, time
    print("ready", flush=True)
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.005)
records = readers.read_manifest(sys.argv[1])
maps = open("/proc/self/maps").read()
print(json.dumps({"parses": calls[0], "ids": [records.id(i) for i in range(3)],
                  "mapped": ".cols" in maps}))
"""


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's column folder (``MMCACHE_COLUMNS_DIR``, inherited by child processes)."""
    where = tmp_path / "columns"
    monkeypatch.setenv("MMCACHE_COLUMNS_DIR", str(where))
    return where


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many times this process's JSONL reader parsed a manifest (``[count]``)."""
    calls = [0]
    real = readers._READERS["jsonl"]

    def counted(f, builder):  # type: ignore[no-untyped-def]
        calls[0] += 1
        real.read(f, builder)

    monkeypatch.setitem(readers._READERS, "jsonl", readers._Registered(counted, real.unit))
    yield calls


def write_manifest(path: Path, n: int, caption: str = "a caption") -> Path:
    rows = [{"id": f"s{i:06d}", "image_path": f"img/{i}.jpg", "caption": caption} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def child(manifest: Path) -> dict[str, object]:
    """:data:`_CHILD` in a new interpreter (this one's ``sys.path`` and environment)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(manifest)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    got: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return got


def cols_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.cols"))


def test_built_once_then_mapped_by_other_processes(
    tmp_path: Path, folder: Path, parses: list[int]
) -> None:
    manifest = write_manifest(tmp_path / "m.jsonl", 500)
    first = mmcache.read_manifest(manifest)
    assert parses[0] == 1 and len(cols_files(folder)) == 1
    again = mmcache.read_manifest(manifest)
    assert parses[0] == 1, "the second read parsed the manifest instead of mapping it"
    assert again.content_digest() == first.content_digest()
    other = child(manifest)
    assert other == {"parses": 0, "ids": ["s000000", "s000001", "s000002"], "mapped": True}


def test_ranks_starting_together_parse_it_once(tmp_path: Path, folder: Path) -> None:
    """Processes that read a new manifest at one moment: one parses (under the build
    lock), the others wait and map what it wrote."""
    manifest = write_manifest(tmp_path / "m.jsonl", 50_000)
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(manifest), str(go)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(3)
    ]
    try:
        for proc in procs:  # every child imported and waiting
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        go.touch()
        outs = [
            json.loads(proc.communicate(timeout=120)[0].strip().splitlines()[-1]) for proc in procs
        ]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert sum(int(out["parses"]) for out in outs) == 1, outs
    assert all(out["mapped"] for out in outs)


def test_workers_map_it_rather_than_copy(tmp_path: Path, folder: Path) -> None:
    """A spawned worker gets the records as the file's name: a pickle of a few hundred
    bytes, not the columns (a forked one shares the mapping itself)."""
    records = mmcache.read_manifest(write_manifest(tmp_path / "m.jsonl", 5000))
    blob = pickle.dumps(records)
    assert len(blob) < 4096 < records.nbytes
    back = pickle.loads(blob)
    assert back.ids(np.arange(5000)) == records.ids(np.arange(5000))
    assert back.stat_paths(np.array([0, 4999])) == records.stat_paths(np.array([0, 4999]))


def test_rewritten_manifest_gets_new_columns(tmp_path: Path, folder: Path) -> None:
    manifest = write_manifest(tmp_path / "m.jsonl", 200, caption="old words")
    assert mmcache.read_manifest(manifest).text(0) == "old words"
    st = manifest.stat()
    write_manifest(manifest, 200, caption="new words")  # same size, same mtime below
    os.utime(manifest, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert manifest.stat().st_size == st.st_size
    assert mmcache.read_manifest(manifest).text(199) == "new words"
    assert child(manifest)["parses"] == 0
    assert len(cols_files(folder)) == 1, "the old columns were kept beside the new ones"


def test_same_stat_rewrite_is_caught_by_the_digest(
    tmp_path: Path, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rewrite that keeps every stat field (a coarse clock's tick) is caught while the
    stat fields cannot vouch: the manifest's bytes are digested and compared."""
    from mmcache.sources import nodecolumns

    manifest = write_manifest(tmp_path / "m.jsonl", 50, caption="old words")
    assert mmcache.read_manifest(manifest).text(0) == "old words"
    frozen = nodecolumns._identity(os.stat(manifest))
    monkeypatch.setattr(nodecolumns, "_identity", lambda st: frozen)
    write_manifest(manifest, 50, caption="new words")
    assert mmcache.read_manifest(manifest).text(0) == "new words"


def damage_truncate(path: Path, other: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def damage_header(path: Path, other: Path) -> None:
    data = bytearray(path.read_bytes())
    data[40] ^= 0x55
    path.write_bytes(bytes(data))


def damage_offsets(path: Path, other: Path) -> None:
    """A valid header over offsets that fall back (the ids' offsets overwritten)."""
    from mmcache.sources.colfile import map_columns

    mapped = map_columns(str(path))
    _, offset, count = mapped._arrays["ids_off"]
    del mapped
    data = bytearray(path.read_bytes())
    data[offset + 8 : offset + 8 * count] = np.full(count - 1, 7, dtype="<i8").tobytes()
    path.write_bytes(bytes(data))


def foreign_copy(path: Path, other: Path) -> None:
    os.replace(other, path)


def symlink(path: Path, other: Path) -> None:
    path.unlink()
    path.symlink_to(other)


def hardlink(path: Path, other: Path) -> None:
    os.link(path, path.with_suffix(".extra"))


def open_mode(path: Path, other: Path) -> None:
    os.chmod(path, 0o664)


def other_user(path: Path, other: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, 12345, 12345)


@pytest.mark.parametrize(
    "spoil",
    [
        damage_truncate,
        damage_header,
        damage_offsets,
        foreign_copy,
        symlink,
        hardlink,
        open_mode,
        other_user,
    ],
)
def test_bad_column_file_is_refused_and_rebuilt(
    tmp_path: Path, folder: Path, parses: list[int], spoil, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    manifest = write_manifest(tmp_path / "m.jsonl", 300)
    other_manifest = write_manifest(tmp_path / "other.jsonl", 300, caption="other words")
    want = mmcache.read_manifest(manifest).content_digest()
    (mine,) = cols_files(folder)
    mmcache.read_manifest(other_manifest)
    (other,) = [p for p in cols_files(folder) if p != mine]
    other_bytes = other.read_bytes()
    spoil(mine, other)
    parses[0] = 0
    got = mmcache.read_manifest(manifest)
    assert parses[0] == 1, "the spoiled column file was used"
    assert got.content_digest() == want and got.text(0) == "a caption"
    assert not mine.is_symlink() and mine.stat().st_nlink == 1
    assert mine.stat().st_mode & 0o777 == 0o600 and mine.stat().st_uid == os.geteuid()
    if other.exists() and not other.is_symlink():
        assert other.read_bytes() == other_bytes, "a link's target was written through"
    parses[0] = 0
    assert mmcache.read_manifest(manifest).content_digest() == want
    assert parses[0] == 0, "the rebuilt file was not mapped"


def test_columns_of_deleted_manifests_are_swept(tmp_path: Path, folder: Path) -> None:
    """A build removes the column files of manifests gone or changed since (bounded), so a
    folder does not fill with the columns of temporary manifests; live ones are kept."""
    gone = write_manifest(tmp_path / "gone.jsonl", 20)
    live = write_manifest(tmp_path / "live.jsonl", 20)
    mmcache.read_manifest(gone)
    mmcache.read_manifest(live)
    assert len(cols_files(folder)) == 2
    gone.unlink()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(mmcache.ManifestError):
        mmcache.read_manifest(bad)  # refused: its build leaves a lock file and no columns
    assert len(list(folder.glob("*.cols.lock"))) == 3
    mmcache.read_manifest(write_manifest(tmp_path / "new.jsonl", 20))  # a build sweeps
    left = cols_files(folder)
    assert len(left) == 2 and len(list(folder.glob("*.cols.lock"))) == 2
    assert child(live)["parses"] == 0, "the live manifest's columns were swept"


def test_gc_sweeps_the_columns_of_every_manifest_gone(
    tmp_path: Path, folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A build sweeps at most ``SWEEP_BUDGET`` files, and only when something is built:
    ``gc`` (of a root, or ``--all`` without one) sweeps every stale one of the folder."""
    manifests = [write_manifest(tmp_path / f"m{i}.jsonl", 10) for i in range(4)]
    for m in manifests:
        mmcache.read_manifest(m)
    assert len(cols_files(folder)) == 4
    manifests[0].unlink()
    manifests[1].unlink()
    with mmcache.Cache(tmp_path / "root", memory=0, disk="8MiB") as cache:
        assert cache.gc().column_files == 2
    assert len(cols_files(folder)) == 2
    manifests[2].unlink()
    from mmcache.cli import main

    assert main(["gc", "--all"]) == 0
    assert "1 column files of manifests gone or changed and" in capsys.readouterr().out
    assert len(cols_files(folder)) == 1
    assert child(manifests[3])["parses"] == 0, "the live manifest's columns were swept"


def test_heap_per_record_after_open_is_bounded(tmp_path: Path, folder: Path) -> None:
    """What a read leaves on this process's heap: nothing per record, whether it built
    the column file (first read) or mapped it (later). The parsed columns alone were
    ~60 B a record here (a manifest of short fields)."""
    n = 20_000
    manifest = write_manifest(tmp_path / "m.jsonl", n)
    for attempt in ("first", "later"):
        tracemalloc.start()
        try:
            records = mmcache.read_manifest(manifest)
            records.stat_paths(np.arange(n))  # the per-epoch check's path table too
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(records) == n
        assert held / n < 8, f"{attempt} read: {held / n:.1f} B of heap per record"
        del records


def test_joined_paths_equal_image_path(tmp_path: Path, folder: Path) -> None:
    """The path table (built with a fast path for plain references) is what
    ``image_path`` says for every kind of reference."""
    refs = [
        "a.jpg",
        "img/a.jpg",
        "./a.jpg",
        "img/./a.jpg",
        "../up/a.jpg",
        "img/../a.jpg",
        "img//a.jpg",
        "/abs/a.jpg",
        "img/",
        "img/..",
        "s3://bucket/a.jpg",
        "café/ü.jpg",
        "dots..jpg",
        ".hidden/a.jpg",
    ]
    rows = [{"id": f"r{i}", "image_path": ref, "caption": ""} for i, ref in enumerate(refs)]
    manifest = tmp_path / "sub" / "m.jsonl"
    manifest.parent.mkdir()
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for records in (mmcache.read_manifest(manifest), mmcache.read_manifest(manifest)):
        got = records.stat_paths(np.arange(len(refs)))
        want = [os.fsencode(records.image_path(i) or "") for i in range(len(refs))]
        assert got == want


def test_off_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, parses: list[int]
) -> None:
    monkeypatch.setenv("MMCACHE_COLUMNS_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    manifest = write_manifest(tmp_path / "m.jsonl", 10)
    assert isinstance(mmcache.read_manifest(manifest), Records)
    assert isinstance(mmcache.read_manifest(manifest), Records)
    assert parses[0] == 2 and not (tmp_path / "xdg").exists()


def _anonymous() -> int:
    """This process's anonymous memory (heap), from ``/proc/self/smaps_rollup``."""
    with open("/proc/self/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no Anonymous line in /proc/self/smaps_rollup")


def test_keying_a_batch_holds_memory_for_that_batch_only(
    tmp_path: Path, folder: Path, small_pipeline
) -> None:  # type: ignore[no-untyped-def]
    """The key memo of a process that keys a few batches (the training process before its
    workers start, the prefetcher) holds pages for those rows, not 48 B for every
    sample (it was filled with -1 when made: 32 B a sample written at once)."""
    if not os.path.exists("/proc/self/smaps_rollup"):
        pytest.skip("needs /proc/self/smaps_rollup")
    n = 200_000
    source = mmcache.MultimodalDataset(
        write_manifest(tmp_path / "m.jsonl", n), pipeline=small_pipeline
    )
    source.key_rows(np.arange(4))  # the first call's own costs (imports, the ledger)
    source._memo_keys = None  # the memo made again below, as in a new process
    before = _anonymous()
    source.key_rows(np.arange(256))
    grown = _anonymous() - before
    assert grown < n * 8, f"keying 256 samples grew the heap by {grown / n:.1f} B per sample"


def test_a_stopped_builder_is_not_waited_for(
    tmp_path: Path, folder: Path, parses: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """A process stopped (SIGSTOP, Ctrl-Z, a suspended job) while it holds a manifest's
    build lock keeps the lock, alive; the other ranks waited for it without end. Now a
    waiter looks the holder up after ``BUILDER_NOTICE_S`` and parses in memory."""
    manifest = write_manifest(tmp_path / "m.jsonl", 200)
    mmcache.read_manifest(manifest)  # the column file and its lock file exist
    (lock,) = [p for p in folder.iterdir() if p.name.endswith(".lock")]
    write_manifest(manifest, 300, caption="rewritten")  # stale: a build is needed
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "time.sleep(600)\n",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    result: list[Records] = []
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        os.kill(holder.pid, signal.SIGSTOP)
        reader = threading.Thread(
            target=lambda: result.append(mmcache.read_manifest(manifest)), daemon=True
        )
        with caplog.at_level(logging.WARNING, logger="mmcache.sources.nodecolumns"):
            reader.start()
            reader.join(timeout=30)
        assert not reader.is_alive(), "the reader still waits for the stopped builder"
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait()
    assert len(result[0]) == 300 and parses[0] == 2  # parsed here, in memory
    assert str(holder.pid) in caplog.text and "stopped" in caplog.text
