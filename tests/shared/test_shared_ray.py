"""``warm(dataset, cache, executor="ray")`` and ``mmcache warm --shared URL --ray`` fill a
share from Ray tasks (a local Ray instance started in the test); a node then trains its
first epoch from it without a decode."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from shared_support import epoch, node, packs, same_batches

from mmcache.cache import Cache
from mmcache.cli import main
from mmcache.dataset import MultimodalDataset
from mmcache.errors import ConfigError
from mmcache.synth import make_dataset
from mmcache.warm import warm

ray = pytest.importorskip("ray", reason="the Ray warm needs pip install 'mmcache[ray]'")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(sys.path)  # Ray's workers import mmcache
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


@pytest.fixture
def data(tmp_path: Path, small_pipeline) -> MultimodalDataset:  # type: ignore[no-untyped-def]
    return MultimodalDataset(make_dataset(tmp_path / "data", 40, seed=6), pipeline=small_pipeline)


def test_a_ray_warm_fills_the_share(local_ray, data, tmp_path):
    share = tmp_path / "share"
    with Cache(tmp_path / "driver", memory=0, disk=None, shared=str(share)) as driver:
        report = warm(data, driver, executor="ray", progress=False)
    assert (report.produced, report.admitted, report.present) == (40, 40, 0)
    assert len(packs(share)) >= 2  # the tasks' own packs (40 samples in parts of 16)
    alone, _ = epoch(data, None)
    with node(tmp_path / "b", str(share)) as b:
        served, stats = epoch(data, b, workers=2)
    assert stats.misses == 0 and stats.tier_hits == {"shared": 40}
    same_batches(served, alone)
    with Cache(tmp_path / "driver", memory=0, disk=None, shared=str(share)) as driver:
        again = warm(data, driver, executor="ray", progress=False)
    assert (again.present, again.produced) == (40, 0)  # resumable: nothing done twice


def test_the_cli_warms_a_share_on_ray(local_ray, data, tmp_path, capsys, tokenizer_json):
    share = tmp_path / "share"
    manifest = tmp_path / "data" / "manifest.jsonl"
    argv = ["warm", str(manifest), "--cache", str(tmp_path / "c"), "--shared", str(share)]
    argv += ["--size", "64", "--max-length", "16", "--tokenizer", str(tokenizer_json)]
    assert main([*argv, "--ray", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["produced"] == 40 and packs(share)


def test_ray_needs_a_shared_tier(data, tmp_path):
    with Cache(tmp_path / "c", memory=0, disk="16MiB") as cache, pytest.raises(ConfigError):
        warm(data, cache, executor="ray", progress=False)
