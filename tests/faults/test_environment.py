"""Faults of the environment: a full disk, a read-only or missing cache root, no
``/dev/shm`` or a tiny one.

The rule: a cache problem never changes what training gets. Either the run stops at
once with a :class:`CacheError` that names the place and the reason
(``fallback="raise"``, the default), or, when the user allows it
(``fallback="uncached"``), training continues without the failing tier after one
warning; a tier that fills up mid-run refuses puts (one warning) and keeps serving
what it holds; nothing half-written is left behind.

Small file systems are real tmpfs mounts made by the tests (skipped where mount is
not permitted). The memory tier's directory is not injectable, so ``/dev/shm`` is
replaced by patching ``mmcache.stores.memory.shm.SHM_DIR``; scenarios that can kill the
process (SIGBUS from a full tmpfs) run in a child process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmcache import cli
from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.errors import CacheError
from mmcache.loader import DataLoader
from mmcache.stores.memory import shm as shm_mod
from mmcache.stores.memory import store_dir
from mmcache.transforms import ImageSpec, TextSpec
from mmcache.transforms.pipeline import Pipeline

SAMPLE_96 = 3 * 96 * 96 + 2 * 4 * 16  # payload of one 96 px sample


def remount_read_only(path: Path) -> None:
    proc = subprocess.run(
        ["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot remount read-only: {proc.stderr.strip()}")


@pytest.fixture
def pipe96(tokenizer_json: Path) -> Pipeline:
    return Pipeline(image=ImageSpec(size=96), text=TextSpec(tokenizer_json, max_length=16))


def epochs(ds: MultimodalDataset, cache: Cache | None, n: int = 2) -> list[dict[str, Any]]:
    loader = DataLoader(ds, cache=cache, batch_size=8, seed=1)
    out: list[dict[str, Any]] = []
    for epoch in range(n):
        loader.set_epoch(epoch)
        out += list(loader)
    return out


def assert_same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"]
        for name in ("image", "input_ids", "attention_mask"):
            assert torch.equal(x[name], y[name]), name


def mmcache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("mmcache")
    ]


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


DISK_FILES = {"cache.json", "disk/data.mdb", "disk/lock.mdb", "disk/stats.i64"}


# ------------------------------------------------------------------------------------------
# disk full
# ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_disk_fills_up_mid_training(
    tmpfs: Any, tiny_data: Path, pipe96: Pipeline, caplog: pytest.LogCaptureFixture
) -> None:
    """A 1 MiB file system under a 64 MiB disk budget: about 30 of 48 samples fit.
    Puts fail cleanly (one warning), training goes on with exactly the batches of an
    uncached run, the tier stays consistent, and puts resume once space is freed."""
    mnt = tmpfs("small-disk", "1m")
    filler = mnt / "filler"
    filler.write_bytes(bytes(256 * 1024))  # another program's data, freed later
    ds = MultimodalDataset(tiny_data, pipeline=pipe96)
    reference = epochs(ds, None, 3)
    root = mnt / "cache"
    caplog.set_level(logging.WARNING)
    with Cache(root, memory=0, disk="64MiB") as cache:
        assert cache.disk is not None
        assert_same(epochs(ds, cache), reference[: len(reference) * 2 // 3])
        warnings = mmcache_warnings(caplog)
        assert len(warnings) == 1 and "full" in warnings[0] and str(root) in warnings[0], warnings
        held = len(cache.disk)
        assert 0 < held < len(ds)
        # nothing half-written: every entry verifies, totals equal the bytes held
        assert cache.verify().ok
        recorded = (cache.disk.nbytes(), len(cache.disk))
        assert recorded == cache.disk.rebuild_totals()  # type: ignore[attr-defined]
        for i in range(len(ds)):
            got = cache.get(ds.key(i))
            if got is not None:
                for name, arr in ds.produce(i).items():
                    np.testing.assert_array_equal(got[name], arr)
        files = files_under(root)
        registry = {f for f in files if f.startswith("fingerprints/")}
        assert files - registry == DISK_FILES
        # the fingerprint registry's files, and no half-written temporary among them
        assert all(
            f.endswith((".json", ".keys")) and not f.rsplit("/", 1)[-1].startswith(".")
            for f in registry
        ), registry
        # space comes back: puts are admitted again, without a restart
        filler.unlink()
        assert_same(epochs(ds, cache, 1), reference[: len(reference) // 3])
        assert len(cache.disk) > held
        assert cache.verify().ok
    assert len(mmcache_warnings(caplog)) == 1


FULL_AT_OPEN = textwrap.dedent(
    """
    import json, logging, sys
    from mmcache.cache import Cache
    from mmcache.errors import CacheError
    logging.basicConfig(level=logging.WARNING)
    root = sys.argv[1]
    out = {}
    try:
        Cache(root, memory=0, disk="64MiB")
        out["raise"] = "opened"
    except CacheError as exc:
        out["raise"] = str(exc)
    with Cache(root, memory="1MiB", disk="64MiB", fallback="uncached", temporary=True) as c:
        out["tiers"] = sorted(c.tiers)
    print(json.dumps(out))
    """
)


def test_a_full_file_system_at_open(tmpfs: Any) -> None:
    mnt = tmpfs("full-disk", "512k")
    with contextlib.suppress(OSError), (mnt / "filler").open("wb", buffering=0) as f:
        while True:
            f.write(bytes(4096))
    root = mnt / "cache"
    proc = subprocess.run(
        [sys.executable, "-c", FULL_AT_OPEN, str(root)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-1500:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert str(root) in out["raise"] and "space" in out["raise"].lower()
    assert out["tiers"] == ["memory"]


# ------------------------------------------------------------------------------------------
# read-only, missing, impossible cache roots
# ------------------------------------------------------------------------------------------


def test_read_only_cache_root(
    tmpfs: Any,
    tiny_data: Path,
    pipe96: Pipeline,
    caplog: pytest.LogCaptureFixture,
) -> None:
    mnt = tmpfs("ro", "4m")
    root = mnt / "cache"
    ds = MultimodalDataset(tiny_data, pipeline=pipe96)
    reference = epochs(ds, None)
    with Cache(root, memory=0, disk="2MiB") as cache:
        epochs(ds, cache, 1)  # a previous run filled it
    remount_read_only(mnt)
    with pytest.raises(CacheError) as info:
        Cache(root, memory=0, disk="2MiB")
    message = str(info.value)
    assert str(root) in message and "Read-only file system" in message
    assert "fallback='uncached'" in message  # the way out
    caplog.set_level(logging.WARNING)
    # fallback: train without the disk tier, with a working memory tier elsewhere
    with Cache(root, memory="1MiB", disk="2MiB", fallback="uncached", temporary=True) as cache:
        assert sorted(cache.tiers) == ["memory"]
        assert_same(epochs(ds, cache), reference)
    warnings = mmcache_warnings(caplog)
    assert len(warnings) == 1 and "Read-only" in warnings[0] and str(root) in warnings[0]


def test_missing_and_impossible_cache_roots(
    tmp_path: Path,
    tiny_data: Path,
    pipe96: Pipeline,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ds = MultimodalDataset(tiny_data, pipeline=pipe96)
    reference = epochs(ds, None, 1)
    # a missing root is created (parents too), private to the user
    root = tmp_path / "a" / "b" / "cache"
    with Cache(root, memory=0, disk="4MiB") as cache:
        assert_same(epochs(ds, cache, 1), reference)
    assert root.stat().st_mode & 0o777 == 0o700
    # a root that cannot exist (below a regular file)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = blocker / "cache"
    with pytest.raises(CacheError) as info:
        Cache(bad, memory=0, disk="4MiB")
    assert str(bad) in str(info.value) and "Not a directory" in str(info.value)
    caplog.set_level(logging.WARNING)
    with Cache(bad, memory=0, disk="4MiB", fallback="uncached") as cache:
        assert cache.tiers == {}
        assert_same(epochs(ds, cache, 1), reference)
    assert len(mmcache_warnings(caplog)) == 1
    # the CLI on a root that is not a cache: exit code 2 and one clear line, no traceback
    for command in ("stats", "verify", "gc"):
        assert cli.main([command, "--cache", str(tmp_path / "nowhere")]) == 2
        err = capsys.readouterr().err
        assert f"mmcache {command}: error:" in err and "not an mmcache cache root" in err
        assert "Traceback" not in err
    assert not (tmp_path / "nowhere").exists()  # inspecting never creates a cache


# ------------------------------------------------------------------------------------------
# no /dev/shm, a tiny /dev/shm
# ------------------------------------------------------------------------------------------


@pytest.fixture
def no_dev_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    missing = tmp_path / "no-dev-shm"
    monkeypatch.setattr(shm_mod, "SHM_DIR", str(missing))
    return missing


def test_no_dev_shm_falls_back_to_the_disk_tier(
    no_dev_shm: Path,
    cache_root: Path,
    tiny_data: Path,
    pipe96: Pipeline,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ds = MultimodalDataset(tiny_data, pipeline=pipe96)
    reference = epochs(ds, None)
    with pytest.raises(CacheError) as info:
        Cache(cache_root, memory="4MiB", disk=None)
    assert "memory tier" in str(info.value) and str(no_dev_shm) in str(info.value)
    caplog.set_level(logging.WARNING)
    with Cache(cache_root, memory="4MiB", disk="4MiB", fallback="uncached") as cache:
        assert sorted(cache.tiers) == ["disk"]
        assert_same(epochs(ds, cache), reference)
        assert cache.stats()["disk"].hits == len(ds)  # the second epoch came from disk
    assert len(mmcache_warnings(caplog)) == 1
    assert not no_dev_shm.exists()


def test_no_dev_shm_message_names_the_missing_directory(no_dev_shm: Path, cache_root: Path) -> None:
    with pytest.raises(CacheError) as info:
        Cache(cache_root, memory="4MiB", disk=None)
    message = str(info.value)
    assert "create it first" not in message
    assert f"{no_dev_shm} does not exist" in message or "No such file or directory" in message


TINY_SHM = textwrap.dedent(
    """
    import contextlib, json, logging, os, sys
    import torch
    from mmcache.stores.memory import shm
    shm_dir, root, manifest, tokenizer, fill = sys.argv[1:6]
    shm.SHM_DIR = shm_dir
    if fill == "full":  # another program's files take every byte of /dev/shm
        with contextlib.suppress(OSError), open(os.path.join(shm_dir, "other"), "wb", 0) as f:
            while True:
                f.write(bytes(4096))
    from mmcache.cache import Cache
    from mmcache.dataset import MultimodalDataset
    from mmcache.loader import DataLoader
    from mmcache.transforms import ImageSpec, TextSpec
    from mmcache.transforms.pipeline import Pipeline
    warnings = []
    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())
    logging.getLogger("mmcache").addHandler(Keep())
    cache = Cache(root, memory="8MiB", disk=None, temporary=True, fallback="uncached")
    pipe = Pipeline(image=ImageSpec(size=64), text=TextSpec(tokenizer, max_length=16))
    ds = MultimodalDataset(manifest, pipeline=pipe)
    same = True
    for c in (None, cache, cache):  # uncached reference, cold, warm
        loader = DataLoader(ds, cache=c, batch_size=8, seed=1)
        got = [(b["id"], b["image"].clone(), b["input_ids"].clone()) for b in loader]
        if c is None:
            ref = got
        else:
            same &= all(a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
                        for a, b in zip(ref, got, strict=True))
    out = {"same": same, "tiers": sorted(cache.tiers), "warnings": warnings}
    if cache.memory is not None:
        out["problems"] = cache.memory.check()
        out["held"] = len(cache.memory)
    cache.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(shm_dir, "other"))
    print(json.dumps(out))
    """
)


def run_tiny_shm(tmpfs: Any, cache_root: Path, tiny_data: Path, tok: Path, fill: str) -> Any:
    shm = tmpfs("tiny-shm", "256k")
    argv = [sys.executable, "-c", TINY_SHM, str(shm), str(cache_root), str(tiny_data), str(tok)]
    proc = subprocess.run([*argv, fill], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-1500:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"], "the batches differ from an uncached run"
    # warnings name /dev/shm; at most one when opening and one when full, never one per put
    assert 1 <= len(out["warnings"]) <= 2, out["warnings"]
    assert all(str(shm) in w for w in out["warnings"])
    mine = os.path.join(str(shm), os.path.basename(store_dir()))  # kept, empty
    assert [f for f in os.listdir(shm) if f != os.path.basename(mine)] == []
    assert not os.path.isdir(mine) or os.listdir(mine) == []  # the temporary store went
    return out


@pytest.mark.slow
def test_a_tiny_dev_shm_refuses_puts_and_training_goes_on(
    tmpfs: Any, cache_root: Path, tiny_data: Path, tokenizer_json: Path
) -> None:
    """256 KiB of /dev/shm under an 8 MiB budget (Docker's --shm-size trap): the tier
    holds what fits, refuses the rest with one warning, stays consistent."""
    out = run_tiny_shm(tmpfs, cache_root, tiny_data, tokenizer_json, "empty")
    assert out["tiers"] == ["memory"] and out["problems"] == [] and out["held"] > 0
    assert any("full" in w for w in out["warnings"])


def test_a_full_dev_shm_at_open(
    tmpfs: Any, cache_root: Path, tiny_data: Path, tokenizer_json: Path
) -> None:
    """/dev/shm already full (another program's or a crashed run's files)."""
    out = run_tiny_shm(tmpfs, cache_root, tiny_data, tokenizer_json, "full")
    assert out["tiers"] == []
