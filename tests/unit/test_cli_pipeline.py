"""``mmcache warm --pipeline module:function`` fills the keys the training script reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mmcache.cli import main

TRAIN = """
import json
import sys

import numpy as np

import mmcache as mc

LEVEL = 7


def shade(im):
    return np.asarray(im.resize((20, 10)), dtype=np.uint8) // 2 + LEVEL


def make_pipeline():
    return mc.Pipeline(image=shade, text=mc.TextSpec({tokenizer!r}, max_length=16))


def not_a_pipeline():
    return 42


if __name__ == "__main__":  # the training run: its own definitions, in __main__
    manifest, root = sys.argv[1:3]
    ds = mc.MultimodalDataset(manifest, pipeline=make_pipeline())
    cache = mc.Cache(root, memory="16MiB", disk="64MiB")
    loader = mc.DataLoader(ds, cache=cache, batch_size=8, num_workers=2, seed=0)
    shapes = {{tuple(b["image"].shape[1:]) for b in loader}}
    epoch = loader.stats().epochs[0]
    del loader
    cache.close()
    print(json.dumps({{"hits": epoch.hits, "misses": epoch.misses, "shapes": sorted(shapes)}}))
"""


def _train(script: Path, manifest: Path, root: Path) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, str(script), str(manifest), str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_warm_with_the_training_scripts_pipeline_gives_zero_misses(
    tiny_data: Path,
    tokenizer_json: Path,
    tmp_path: Path,
    cache_root: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN.format(tokenizer=str(tokenizer_json))))
    root = cache_root  # its shared memory (the training script's tier) is removed after
    args = ["warm", str(tiny_data), "--cache", str(root), "--workers", "0", "--disk", "64MiB"]
    capsys.readouterr()
    assert main([*args, "--pipeline", f"{script}:make_pipeline", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total"] == 48 and report["admitted"] == 48
    trained = _train(script, tiny_data, root)
    assert trained == {"hits": 48, "misses": 0, "shapes": [[3, 10, 20]]}


def test_warm_without_the_pipeline_fills_other_keys(
    tiny_data: Path,
    tokenizer_json: Path,
    tmp_path: Path,
    cache_root: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN.format(tokenizer=str(tokenizer_json))))
    root = cache_root  # its shared memory (the training script's tier) is removed after
    args = ["warm", str(tiny_data), "--cache", str(root), "--workers", "0", "--disk", "64MiB"]
    assert main([*args, "--tokenizer", str(tokenizer_json), "--max-length", "16", "--json"]) == 0
    assert _train(script, tiny_data, root)["misses"] == 48  # the default pipeline's keys


def test_warm_pipeline_errors(
    tiny_data: Path, tokenizer_json: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN.format(tokenizer=str(tokenizer_json))))
    args = ["warm", str(tiny_data), "--cache", str(tmp_path / "c"), "--workers", "0"]
    capsys.readouterr()
    assert main([*args, "--pipeline", f"{script}:not_a_pipeline"]) == 2
    assert "returned a int; it must return the mmcache.Pipeline" in capsys.readouterr().err
    assert main([*args, "--pipeline", f"{script}:make_pipeline", "--size", "64"]) == 2
    assert "--size describe the default pipeline" in capsys.readouterr().err
    assert main([*args, "--pipeline", f"{script}:missing"]) == 2
    assert "has no attribute 'missing'" in capsys.readouterr().err
    assert main([*args, "--pipeline", "no_such_module_xyz:make"]) == 2
    assert "cannot import 'no_such_module_xyz' for pipeline" in capsys.readouterr().err
