"""A damaged disk tier: truncated ``data.mdb``, lost or forged totals, short meta
records, a hand-edited ``cache.json``.

Each case damages the files of a real cache the way an interrupted copy, a bad
restore, bit rot or a hand edit would (through a raw LMDB handle or plain file
I/O, never through mmcache), then runs what a user runs: the CLI, ``Cache`` and
``DiskStore``. What must hold: a clear error naming the file and the fix (or the
``fallback="uncached"`` path), ``mmcache verify --repair`` repairs what it can,
the budget holds, and never a signal or a ``struct.error``.

Cases that could kill the interpreter (SIGBUS from a truncated memory map) run in
a child process: a signal shows as a negative return code and fails the test
instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from mmcache.cache import Cache
from mmcache.cli import main
from mmcache.errors import CacheError
from mmcache.keys import sample_key
from mmcache.stores.disk import DiskStore

N = 40
VALUE_BYTES = 20_000


def _key(i: int) -> bytes:
    return sample_key(f"id{i}", "stamp", "fp")


def _sample(i: int) -> dict[str, np.ndarray]:
    return {"x": np.full(VALUE_BYTES, i % 251, dtype=np.uint8), "i": np.array([i], np.int64)}


def _fill(root: Path, n: int = N, disk: str = "16MiB") -> int:
    """A cache root holding ``n`` entries on disk; returns the payload bytes held."""
    with Cache(root, memory=0, disk=disk) as cache:
        for i in range(n):
            assert cache.put(_key(i), _sample(i))
        assert cache.disk is not None
        return cache.disk.nbytes()


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, check=False
    )


def _damage(path: Path, db: bytes, key: bytes, value: bytes | None) -> None:
    """Replace (or delete, for None) one record of the LMDB database ``db`` under
    ``path``, bypassing mmcache: a bad restore, bit rot or a hand edit."""
    with lmdb.open(str(path), subdir=True, max_dbs=3, map_size=1 << 26) as env:
        handle = env.open_db(db, create=False)
        with env.begin(write=True) as txn:
            if value is None:
                assert txn.delete(key, db=handle)
            else:
                assert txn.replace(key, value, db=handle) is not None


# ------------------------------------------------------------------ a truncated data.mdb

READ_LOOP = textwrap.dedent(
    """
    import json, sys
    from mmcache.cache import Cache
    from mmcache.errors import CacheError
    from mmcache.keys import sample_key

    root, fallback = sys.argv[1], sys.argv[2]
    try:
        cache = Cache(root, memory=0, disk="16MiB", fallback=fallback)
    except CacheError as exc:
        print(json.dumps({"error": str(exc)}))
        sys.exit(0)
    with cache:
        hits = sum(cache.get(sample_key(f"id{i}", "stamp", "fp")) is not None for i in range(40))
    print(json.dumps({"hits": hits, "disk": cache.disk is not None}))
    """
)


@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_a_truncated_data_mdb_is_a_clear_error_never_sigbus(
    cache_root: Path, fraction: float
) -> None:
    _fill(cache_root)
    data = cache_root / "disk" / "data.mdb"
    size = int(data.stat().st_size * fraction)
    os.truncate(data, size)  # an interrupted copy or restore

    for command in ("verify", "stats"):
        proc = _run("-m", "mmcache.cli", command, "--cache", str(cache_root))
        assert proc.returncode == 2, (command, proc.returncode, proc.stdout, proc.stderr)
        assert "data.mdb" in proc.stderr and "truncated" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr

    proc = _run("-c", READ_LOOP, str(cache_root), "raise")
    assert proc.returncode == 0, (proc.returncode, proc.stderr)  # -7 would be SIGBUS
    result = json.loads(proc.stdout)
    assert "truncated" in result["error"] and "data.mdb" in result["error"], result

    proc = _run("-c", READ_LOOP, str(cache_root), "uncached")
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert json.loads(proc.stdout) == {"hits": 0, "disk": False}  # trained without the tier
    assert "truncated" in proc.stderr  # the one warning says why

    with pytest.raises(CacheError, match="truncated"):
        DiskStore(cache_root / "disk", capacity="16MiB", readonly=True)
    assert data.stat().st_size == size  # opening never touched the evidence


# ------------------------------------------------------------------ the totals record


def test_a_missing_totals_record_is_repaired_by_verify_repair(
    cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    held = _fill(cache_root)
    _damage(cache_root / "disk", b"info", b"totals", None)
    with DiskStore(cache_root / "disk", capacity="16MiB", readonly=True) as store:
        with pytest.raises(CacheError, match="verify --repair"):  # a reader cannot repair it
            store.nbytes()
        assert store.get(_key(1)) is not None  # its entries are still served
    capsys.readouterr()
    assert main(["verify", "--cache", str(cache_root), "--repair"]) == 0
    assert "0 bad" in capsys.readouterr().out
    assert main(["stats", "--cache", str(cache_root), "--json"]) == 0
    disk = json.loads(capsys.readouterr().out)["disk"]
    assert (disk["items"], disk["bytes"]) == (N, held)


@pytest.mark.parametrize(
    "forged", [(-(2**60), N, N, 1), (2**62, N, N, 1), (0, 0, 0, 0), (100, -5, N, 1)]
)
def test_forged_totals_never_let_the_tier_outgrow_its_budget(
    cache_root: Path, forged: tuple[int, int, int, int]
) -> None:
    _fill(cache_root, n=N, disk="1MiB")
    _damage(cache_root / "disk", b"info", b"totals", struct.pack("<qqqq", *forged))
    with Cache(cache_root, memory=0, disk="1MiB") as cache:
        store = cache.disk
        assert isinstance(store, DiskStore)
        for i in range(N, 5 * N):  # 4 MB more through a 1 MiB budget
            cache.put(_key(i), _sample(i))
            assert 0 <= store.nbytes() <= 1024 * 1024
        bytes_held, items = store.rebuild_totals()  # recount what is really there
        assert bytes_held == store.nbytes() <= 1024 * 1024 and items == len(store) > 0
        assert cache.verify().ok


def test_forged_totals_are_a_clear_error_for_a_reader(cache_root: Path) -> None:
    _fill(cache_root)
    _damage(cache_root / "disk", b"info", b"totals", struct.pack("<qqqq", -(2**60), N, N, 1))
    with DiskStore(cache_root / "disk", capacity="16MiB", readonly=True) as store:
        with pytest.raises(CacheError, match=r"totals.*verify --repair"):
            store.nbytes()
        assert store.get(_key(1)) is not None  # the entries themselves are still served


# ------------------------------------------------------------------ a damaged meta record


def test_a_short_meta_record_is_found_by_verify_and_removed_by_repair(
    cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    held = _fill(cache_root)
    _damage(cache_root / "disk", b"meta", _key(3), b"xx")
    _damage(cache_root / "disk", b"meta", _key(5), None)  # a value without its record
    with DiskStore(cache_root / "disk", capacity="16MiB", policy="lru") as store:
        with pytest.raises(CacheError, match="meta record"):
            store.info(_key(3))
        assert store.info(_key(4)) is not None
    capsys.readouterr()
    assert main(["verify", "--cache", str(cache_root)]) == 1
    out = capsys.readouterr().out
    assert "2 bad" in out and _key(3).hex() in out and _key(5).hex() in out
    assert main(["verify", "--cache", str(cache_root), "--repair"]) == 0
    assert "2 removed" in capsys.readouterr().out
    assert main(["verify", "--cache", str(cache_root)]) == 0
    with DiskStore(cache_root / "disk", capacity="16MiB", readonly=True) as store:
        assert store.info(_key(3)) is None and store.get(_key(5)) is None
        assert len(store) == N - 2 and store.nbytes() == held - 2 * (held // N)


@pytest.mark.parametrize("record", [b"xx", struct.pack("<qdddqq", -(2**60), 0, 0, 0, 0, 7)])
def test_writes_over_a_damaged_meta_record_keep_the_store_consistent(
    tmp_path: Path, record: bytes
) -> None:
    path = tmp_path / "d"
    with DiskStore(path, capacity=10 * VALUE_BYTES, policy="lru") as store:
        for i in range(5):
            assert store.put(_key(i), bytes(VALUE_BYTES))
    _damage(path, b"meta", _key(1), record)
    _damage(path, b"meta", _key(2), record)
    with DiskStore(path, capacity=10 * VALUE_BYTES, policy="lru") as store:
        assert store.get(_key(1)) is not None
        assert store.put(_key(1), bytes(VALUE_BYTES))  # replaces the damaged entry
        assert store.delete(_key(2))
        for i in range(10, 30):  # evictions over the rest
            assert store.put(_key(i), bytes(VALUE_BYTES))
            assert 0 <= store.nbytes() <= 10 * VALUE_BYTES
        store.flush()
        assert store.expire(0.0) == 0
        assert store.rebuild_totals() == (store.nbytes(), len(store))
        assert store.verify(lambda value: True) == []


# ------------------------------------------------------------------ a hand-edited cache.json

BAD_CONFIG: list[tuple[str, Any]] = [
    ("memory", True),
    ("memory", 1e30),
    ("memory", "lots"),
    ("disk", True),
    ("disk", "-1GiB"),
    ("ttl", "forever"),
    ("ttl", float("nan")),
]


@pytest.mark.parametrize(("field", "value"), BAD_CONFIG)
@pytest.mark.parametrize("command", ["stats", "verify", "gc"])
def test_every_command_refuses_the_same_bad_cache_json(
    cache_root: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    field: str,
    value: Any,
) -> None:
    _fill(cache_root, n=2)
    path = cache_root / "cache.json"
    config = json.loads(path.read_text())
    config[field] = value
    path.write_text(json.dumps(config))
    capsys.readouterr()
    assert main([command, "--cache", str(cache_root)]) == 2
    err = capsys.readouterr().err
    assert "cache.json" in err and repr(field) in err and repr(value) in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert path.read_text() == json.dumps(config)  # left as it was, for the user to fix


def test_a_good_cache_json_still_opens(cache_root: Path) -> None:
    _fill(cache_root, n=2)
    path = cache_root / "cache.json"
    config = json.loads(path.read_text())
    config.update(memory="auto", disk="16MiB", ttl="7d")
    path.write_text(json.dumps(config))
    with Cache.open_existing(cache_root, memory=0) as cache:
        assert cache.disk_budget == 16 * 1024 * 1024 and cache.ttl == 7 * 86400
        assert cache.verify().checked == 2
