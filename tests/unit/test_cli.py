"""The CLI: each command on small data, in-process (main(argv)) and once as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mmcache.cli import main
from mmcache.stores.memory import store_dir


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("demo", "synth", "warm", "stats", "verify", "gc"):
        assert cmd in out
    for cmd in ("demo", "synth", "warm", "stats", "verify", "gc"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        assert "usage" in capsys.readouterr().out


def test_demo_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "demo.png"
    code = main(
        [
            "demo",
            "--n",
            "64",
            "--epochs",
            "2",
            "--workers",
            "1",
            "--size",
            "32",
            "--batch-size",
            "16",
            "--plot",
            str(png),
            "--json",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "samples/s" in out and png.stat().st_size > 1000
    stats = json.loads(out[out.index("{") :])
    assert stats["epochs"][0]["misses"] == 64 and stats["epochs"][1]["hits"] == 64


def test_warm_stats_verify_gc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["synth", str(tmp_path / "data"), "--n", "12"]) == 0
    manifest = tmp_path / "data" / "manifest.jsonl"
    cache = tmp_path / "cache"
    capsys.readouterr()
    assert (
        main(
            [
                "warm",
                str(manifest),
                "--cache",
                str(cache),
                "--workers",
                "0",
                "--size",
                "32",
                "--disk",
                "64MiB",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["total"] == 12 and report["admitted"] == 12
    # resumable: a second run finds everything present
    assert (
        main(
            [
                "warm",
                str(manifest),
                "--cache",
                str(cache),
                "--workers",
                "0",
                "--size",
                "32",
                "--disk",
                "64MiB",
                "--json",
            ]
        )
        == 0
    )
    again = json.loads(capsys.readouterr().out)
    assert again["present"] == 12 and again["produced"] == 0
    assert main(["stats", "--cache", str(cache), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["disk"]["items"] == 12 and stats["disk"]["budget"] == 64 * 2**20
    assert len(stats["fingerprints"]) == 1  # the default pipeline's
    assert main(["stats", "--cache", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "disk" in out and "pipeline fingerprints" in out and "12 keys" in out
    assert main(["verify", "--cache", str(cache), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["gc", "--cache", str(cache), "--older-than", "7d", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expired"] == 0
    assert main(["gc", "--cache", str(cache), "--max-size", "10KiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["evicted"] > 0
    assert main(["gc", "--cache", str(cache), "--unused-for", "1h", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dropped_fingerprints"] == []  # used just now


def test_verify_exit_code_on_a_corrupt_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import lmdb

    assert main(["synth", str(tmp_path / "data"), "--n", "3"]) == 0
    cache = tmp_path / "cache"
    assert (
        main(
            [
                "warm",
                str(tmp_path / "data" / "manifest.jsonl"),
                "--cache",
                str(cache),
                "--workers",
                "0",
                "--size",
                "32",
                "--disk",
                "8MiB",
            ]
        )
        == 0
    )
    env = lmdb.open(str(cache / "disk"), max_dbs=8)
    data = env.open_db(b"data")
    with env.begin(write=True) as txn:
        key, value = next(iter(txn.cursor(db=data)))
        txn.put(key, value[:-1] + bytes([value[-1] ^ 1]), db=data)
    env.close()
    capsys.readouterr()
    assert main(["verify", "--cache", str(cache)]) == 1
    assert "1 bad" in capsys.readouterr().out
    assert main(["verify", "--cache", str(cache), "--repair"]) == 0
    assert main(["verify", "--cache", str(cache)]) == 0


def test_errors_are_one_line_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stats", "--cache", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "not an mmcache cache root" in err and "Traceback" not in err


def test_console_script_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mmcache.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "demo" in out.stdout


def test_bench_on_user_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["synth", str(tmp_path / "data"), "--n", "40"]) == 0
    capsys.readouterr()
    assert (
        main(
            [
                "bench",
                str(tmp_path / "data" / "manifest.jsonl"),
                "--budget",
                "50%",
                "--epochs",
                "2",
                "--workers",
                "1",
                "--size",
                "32",
                "--batch-size",
                "8",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["samples"] == 40 and out["uncached_samples_per_s"] > 0
    assert out["memory"] == out["data_bytes"] // 2
    e0, e1 = out["epochs"]
    assert e0["misses"] == 40 and 0.4 <= e1["hit_rate"] <= 0.6
    assert (
        main(
            [
                "bench",
                str(tmp_path / "data" / "manifest.jsonl"),
                "--budget",
                "1MiB",
                "--epochs",
                "1",
                "--workers",
                "0",
                "--size",
                "32",
                "--no-baseline",
            ]
        )
        == 0
    )
    assert "mmcache epoch 0" in capsys.readouterr().out


# -- reopening from the CLI changes nothing it was not asked to change --------------------
def _populated(root: Path, n: int = 20, *, memory: str = "1MiB") -> list[bytes]:
    """A cache root (not temporary) holding ``n`` fresh entries in both tiers."""
    import numpy as np

    from mmcache.cache import Cache
    from mmcache.keys import sample_key

    keys = [sample_key(f"id{i}", "stamp", "fp") for i in range(n)]
    with Cache(root, memory=memory, disk="4MiB") as cache:
        for i, k in enumerate(keys):
            cache.put(k, {"x": np.full(1000, i + 1, dtype=np.uint8)})
    return keys


def _entries(root: Path) -> dict[str, int]:
    from mmcache.cache import Cache

    with Cache.open_existing(root) as cache:
        return {name: len(tier) for name, tier in cache.tiers.items()}


def test_gc_older_than_applies_once_and_nothing_is_persisted(
    cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import time

    _populated(cache_root)
    config = (cache_root / "cache.json").read_bytes()
    assert main(["gc", "--cache", str(cache_root), "--older-than", "3s", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expired"] == 0
    assert (cache_root / "cache.json").read_bytes() == config
    time.sleep(4)
    assert main(["gc", "--cache", str(cache_root), "--json"]) == 0  # only orphans, corrupt
    assert json.loads(capsys.readouterr().out)["expired"] == 0
    assert _entries(cache_root) == {"memory": 20, "disk": 20}
    for argv in (["stats"], ["verify"], ["verify", "--repair"], ["gc", "--unused-for", "1d"]):
        assert main([*argv, "--cache", str(cache_root)]) == 0
        assert (cache_root / "cache.json").read_bytes() == config, argv
    capsys.readouterr()
    assert _entries(cache_root) == {"memory": 20, "disk": 20}
    assert main(["gc", "--cache", str(cache_root), "--older-than", "1s", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["expired"] == 2 * 20  # both tiers, once
    assert _entries(cache_root) == {"memory": 0, "disk": 0}


def test_warm_keeps_an_existing_roots_budgets_unless_disk_is_passed(
    tmp_path: Path, cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 12 item 2: warm (memory=0, a default disk budget) never rewrites cache.json;
    an explicit --disk changes the recorded disk budget and nothing else."""
    import glob

    from mmcache.cache import Cache, _memory_name

    assert main(["synth", str(tmp_path / "data"), "--n", "4"]) == 0
    with Cache(cache_root, memory="1MiB", disk="4MiB", policy="lru", ttl="7d", temporary=True):
        pass
    config = (cache_root / "cache.json").read_bytes()
    argv = ["warm", str(tmp_path / "data" / "manifest.jsonl"), "--cache", str(cache_root)]
    argv += ["--workers", "0", "--size", "32", "--json"]
    capsys.readouterr()
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["admitted"] == 4
    assert (cache_root / "cache.json").read_bytes() == config
    assert main([*argv, "--policy", "fifo"]) == 0  # for this run only
    assert json.loads(capsys.readouterr().out)["present"] == 4
    assert (cache_root / "cache.json").read_bytes() == config
    name = _memory_name(cache_root.absolute())
    assert glob.glob(f"{store_dir()}/mmcache-{name}*") == []  # warm made no memory tier
    assert main(["stats", "--cache", str(cache_root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["disk"]["budget"] == 4 * 2**20
    assert main([*argv, "--disk", "8MiB"]) == 0
    recorded = json.loads((cache_root / "cache.json").read_text())
    assert recorded == {**json.loads(config), "disk": 8 * 2**20}
    with Cache.open_existing(cache_root, memory=0) as cache:
        assert cache.disk is not None and cache.disk.capacity() == 8 * 2**20
        assert cache.policy.name == "lru" and cache.ttl == 7 * 86400
    fresh = tmp_path / "fresh"  # a new root records what warm opened it with
    assert main(["warm", *argv[1:3], str(fresh), *argv[4:]]) == 0
    recorded = json.loads((fresh / "cache.json").read_text())
    assert (recorded["memory"], recorded["disk"], recorded["policy"]) == (0, 50 * 2**30, "value")


def test_verify_checks_the_memory_tier_and_repairs_it(
    cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A byte flipped in /dev/shm is reported bad (naming the tier) and --repair removes it."""
    import glob

    from mmcache.cache import _memory_name
    from mmcache.keys import key_hex

    keys = _populated(cache_root, 8)
    marker = bytes([5]) * 1000  # the payload of entry 4 (values i + 1)
    flipped = 0
    for path in glob.glob(f"{store_dir()}/mmcache-{_memory_name(cache_root.absolute())}-d*"):
        with open(path, "r+b") as f:
            data = f.read()
            at = data.find(marker)
            if at >= 0:
                f.seek(at + 500)
                f.write(b"\x06")
                flipped += 1
    assert flipped == 1
    capsys.readouterr()
    assert main(["verify", "--cache", str(cache_root), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["tiers"] == ["memory", "disk"]
    assert report["bad"] == [key_hex(keys[4])] and report["bad_tiers"] == ["memory"]
    assert main(["verify", "--cache", str(cache_root)]) == 1
    out = capsys.readouterr().out
    assert "memory and disk tiers" in out and f"{key_hex(keys[4])} (memory tier)" in out
    assert main(["verify", "--cache", str(cache_root), "--repair"]) == 0
    assert "1 bad, 1 removed" in capsys.readouterr().out
    assert main(["verify", "--cache", str(cache_root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert _entries(cache_root) == {"memory": 7, "disk": 8}


def test_stats_and_verify_leave_the_memory_tier_and_counters_alone(
    cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """stats never creates the memory tier; verify counts no hits or misses."""
    import glob

    from mmcache.cache import _memory_name
    from mmcache.stores.memory import unlink_store

    _populated(cache_root, 5)
    capsys.readouterr()
    assert main(["stats", "--cache", str(cache_root), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert main(["verify", "--cache", str(cache_root)]) == 0
    capsys.readouterr()
    assert main(["stats", "--cache", str(cache_root), "--json"]) == 0
    after = json.loads(capsys.readouterr().out)
    for tier in ("memory", "disk"):
        assert (after[tier]["hits"], after[tier]["misses"]) == (
            before[tier]["hits"],
            before[tier]["misses"],
        ), tier
    name = _memory_name(cache_root.absolute())
    unlink_store(name)
    assert main(["stats", "--cache", str(cache_root)]) == 0
    assert "memory tier: not present" in capsys.readouterr().out
    assert main(["stats", "--cache", str(cache_root), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert "memory" not in stats and stats["not_present"] == ["memory"]
    assert main(["verify", "--cache", str(cache_root)]) == 0
    assert "memory tier: not present" in capsys.readouterr().out
    assert main(["gc", "--cache", str(cache_root)]) == 0
    assert glob.glob(f"{store_dir()}/mmcache-{name}*") == []
