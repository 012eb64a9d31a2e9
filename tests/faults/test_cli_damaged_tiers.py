"""A damaged tier seen through the CLI: ``stats`` and ``verify`` say which tier is
damaged and how, the fix they name works, and ``verify --repair``/``gc`` recover.

The memory tier: a data segment truncated while nobody is attached (``: >
/dev/shm/...-dNNN`` between runs). The disk tier: a damaged LMDB page (bit rot, a
bad restore) in ``data.mdb``, written with plain file I/O.
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mmcache.cache import Cache
from mmcache.cli import main
from mmcache.keys import sample_key
from mmcache.stores.memory import store_exists


def _key(i: int) -> bytes:
    return sample_key(f"id{i}", "stamp", "fp")


def _sample(i: int, n: int = 2000) -> dict[str, np.ndarray]:
    return {"x": np.full(n, i % 251, dtype=np.uint8), "i": np.array([i], np.int64)}


def test_a_truncated_memory_tier_is_reported_and_removed_by_the_command_named(
    cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Cache(cache_root, memory="4MiB", disk="4MiB", policy="lru") as cache:
        for i in range(4):
            assert cache.put(_key(i), _sample(i))
        assert cache.memory is not None
        name = cache.memory_name
        segment = next(p for p in cache.memory.segment_paths() if p[-5:-3] == "-d")
    Path(segment).write_bytes(b"")  # nobody attached any more

    assert main(["stats", "--cache", str(cache_root)]) == 0
    out = capsys.readouterr().out
    assert "memory tier: damaged" in out and "truncated" in out, out
    assert main(["verify", "--cache", str(cache_root)]) == 1
    out = capsys.readouterr().out
    assert "memory tier: damaged" in out and "truncated" in out, out
    fix = re.search(r"remove it with mmcache (gc --cache \S+)", out)
    assert fix is not None, out
    assert "fallback=" not in out  # an option the CLI does not have

    assert main(fix.group(1).split()) == 0  # the advice works
    assert "0 orphaned" not in capsys.readouterr().out
    assert not store_exists(name)
    assert main(["verify", "--cache", str(cache_root)]) == 0
    assert "memory tier: not present" in capsys.readouterr().out
    with Cache(cache_root, memory="4MiB", disk="4MiB", policy="lru") as cache:
        assert cache.get(_key(0)) is not None  # from the disk tier; memory is new


def test_verify_repair_removes_a_truncated_memory_tier(
    cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Cache(cache_root, memory="4MiB", disk="1MiB", policy="lru") as cache:
        assert cache.put(_key(0), _sample(0))
        assert cache.memory is not None
        name = cache.memory_name
        segment = next(p for p in cache.memory.segment_paths() if p[-5:-3] == "-d")
    Path(segment).write_bytes(b"")
    assert main(["verify", "--repair", "--cache", str(cache_root)]) == 0
    assert "damaged store removed" in capsys.readouterr().out
    assert not store_exists(name)


# ------------------------------------------------------------------ a damaged LMDB page

PAGE = 4096
P_LEAF = 0x02


def _leaf_pages(data_mdb: Path) -> list[tuple[int, int]]:
    """``(page number, keys)`` of the leaf pages of ``data_mdb`` (LMDB's page header:
    flags at byte 10, the lower bound of the free space at byte 12)."""
    raw = data_mdb.read_bytes()
    pages = []
    for n in range(2, len(raw) // PAGE):  # pages 0 and 1 are the meta pages
        flags, lower = struct.unpack_from("<HH", raw, n * PAGE + 10)
        if flags & P_LEAF and lower >= 16:
            pages.append((n, (lower - 16) // 2))
    return pages


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a child process: a damaged page must never kill it with a signal."""
    return subprocess.run(
        [sys.executable, "-m", "mmcache.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("damage", ["random bytes", "bounds zeroed"])
def test_a_damaged_lmdb_page_is_reported_and_salvaged(cache_root: Path, damage: str) -> None:
    n = 300
    with Cache(cache_root, memory=0, disk="16MiB") as cache:
        for i in range(n):
            assert cache.put(_key(i), _sample(i, 200))
    data_mdb = cache_root / "disk" / "data.mdb"
    # the fullest leaf page past the first: a page of entries of the data or meta db
    page, _keys = max(_leaf_pages(data_mdb)[1:], key=lambda p: p[1])
    with data_mdb.open("r+b") as fh:
        if damage == "random bytes":
            fh.seek(page * PAGE)
            fh.write(np.random.default_rng(7).integers(0, 256, PAGE, np.uint8).tobytes())
        else:
            fh.seek(page * PAGE + 12)
            fh.write(b"\0" * 4)  # mp_lower, mp_upper

    root = str(cache_root)
    proc = _cli("stats", "--cache", root)
    assert proc.returncode == 0, proc
    assert "disk tier: damaged" in proc.stdout and "B-tree" in proc.stdout, proc.stdout
    proc = _cli("verify", "--cache", root)
    assert proc.returncode == 1, proc
    assert "disk tier: damaged" in proc.stdout and "verify --repair" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr

    proc = _cli("verify", "--repair", "--cache", root)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    found = re.search(r"salvaged (\d+) entries", proc.stdout)
    assert found is not None, proc.stdout
    kept = int(found.group(1))
    assert n // 2 < kept <= n  # one page of entries lost at most, never the tier

    proc = _cli("verify", "--cache", root)
    assert proc.returncode == 0 and "0 bad" in proc.stdout, (proc.stdout, proc.stderr)
    assert "damaged" not in _cli("stats", "--cache", root).stdout
    with Cache(cache_root, memory=0, disk="16MiB") as cache:
        held = [i for i in range(n) if cache.get(_key(i)) is not None]
        assert len(held) == kept == len(cache.disk or ())
        assert all(int(cache.get(_key(i))["i"][0]) == i for i in held)  # type: ignore[index]
        assert cache.put(_key(n), _sample(n, 200))  # and it takes writes again
