"""Bad command-line arguments: one line naming the flag and the value, exit 2, no traceback.

Every case runs the real ``mmcache`` console script in its own process, as a user
types it; values starting with ``-`` must reach the validator (argparse would
otherwise take ``-1GiB`` for an option and say "expected one argument").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = ["--n", "8", "--size", "32", "--workers", "0", "--batch-size", "4"]

# (argv with {manifest}/{root}/{out} placeholders, the flag or value the message must name)
CASES = {
    "synth-into-a-file": (["synth", "/dev/null/x", "--n", "2"], ["/dev/null/x"]),
    "synth-n-0": (["synth", "{out}", "--n", "0"], ["--n", "0"]),
    "warm-workers-negative": (
        ["warm", "{manifest}", "--cache", "{root}", "--size", "32", "--workers", "-1"],
        ["--workers", "-1"],
    ),
    "warm-disk-negative": (
        ["warm", "{manifest}", "--cache", "{root}", "--disk", "-1GiB"],
        ["--disk", "-1GiB"],
    ),
    "warm-disk-negative-equals": (
        ["warm", "{manifest}", "--cache", "{root}", "--disk=-1GiB"],
        ["--disk", "-1GiB"],
    ),
    "gc-older-than-negative": (["gc", "--cache", "{root}", "--older-than", "-3d"], ["-3d"]),
    "gc-max-size-negative": (["gc", "--cache", "{root}", "--max-size", "-5"], ["--max-size"]),
    "bench-budget-negative": (
        ["bench", "{manifest}", "--budget", "-10%", "--size", "32", "--workers", "0"],
        ["--budget", "-10%"],
    ),
    "bench-epochs-negative": (
        ["bench", "{manifest}", "--epochs", "-1", "--size", "32", "--workers", "0"],
        ["--epochs", "-1"],
    ),
    "demo-epochs-negative": (["demo", *SMALL, "--epochs", "-1"], ["--epochs", "-1"]),
    "demo-budget-negative": (["demo", *SMALL, "--budget", "-1"], ["--budget", "-1"]),
    "demo-budget-nan": (["demo", *SMALL, "--budget", "nan"], ["--budget", "nan"]),
}


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmcache.synth import make_dataset

    return make_dataset(tmp_path_factory.mktemp("cli-args"), 4, seed=0)


def _mmcache() -> list[str]:
    script = Path(sys.executable).with_name("mmcache")
    if not script.exists():
        pytest.skip(f"no mmcache console script beside {sys.executable} (pip install -e .)")
    return [str(script)]


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_argument_is_one_line_naming_flag_and_value(
    case: str, manifest: Path, tmp_path: Path
) -> None:
    argv, named = CASES[case]
    subs = {"manifest": str(manifest), "root": str(tmp_path / "cache"), "out": str(tmp_path)}
    argv = [a.format(**subs) for a in argv]
    env = {**os.environ, "MPLBACKEND": "Agg"}
    run = subprocess.run(
        [*_mmcache(), *argv], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    err = run.stderr.strip()
    assert run.returncode == 2, (run.returncode, run.stdout[-500:], err[-2000:])
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    for word in named:
        assert word in err, (word, err)
    assert not (tmp_path / "manifest.jsonl").exists()  # synth --n 0 wrote nothing


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["gc", "--cache", "{root}", "--max-size", "99999999TiB"], "--max-size"),
        (["gc", "--cache", "{root}", "--max-size", "10XB"], "--max-size"),
        (["warm", "{root}/m.jsonl", "--cache", "{root}", "--disk", "99999999TiB"], "--disk"),
        (["bench", "{root}/m.jsonl", "--budget", "99999999TiB"], "--budget"),
    ],
)
def test_a_size_error_names_the_flag_typed_not_the_parameter(
    argv: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 23: ``--max-size 99999999TiB`` said "size must be at most 2**62 bytes" (the
    library's parameter); the flag the user typed is what the message names."""
    from mmcache.cli import main

    with pytest.raises(SystemExit) as stopped:
        main([a.format(root=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert f"{flag} must be at most" in err or f"in {flag} '" in err, err
    assert ": size must" not in err and "in size '" not in err and ": budget must" not in err, err
