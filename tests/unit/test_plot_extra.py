"""matplotlib is the ``plot`` extra: mmcache imports and trains without it, and the two
entries that draw a figure (``mmcache.plot`` and ``mmcache demo``) say which extra to
install instead of failing with an ImportError (or, for the demo, after its epochs).

Each case runs in a fresh interpreter whose import system cannot find matplotlib (a
``sys.meta_path`` finder placed first), which is what an install without the extra sees:
the shared environment keeps matplotlib installed for the other tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mmcache

_WITHOUT_MATPLOTLIB = '''
import sys


class _NoMatplotlib:
    """An install without the plot extra: matplotlib and its submodules cannot be found."""

    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoMatplotlib())
'''


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # the mmcache under test, whether installed or on PYTHONPATH
    src = str(Path(mmcache.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_MATPLOTLIB + code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_import_works_and_plot_names_the_extra(tmp_path: Path) -> None:
    done = _run(
        """
import mmcache
import mmcache.cli
assert not any(m.split(".")[0] == "matplotlib" for m in sys.modules), "matplotlib loaded"
try:
    mmcache.plot([], "out.png")
except mmcache.ConfigError as exc:
    print("refused:", exc)
""",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "pip install 'mmcache[plot]'" in done.stdout
    assert not (tmp_path / "out.png").exists()


def test_demo_plot_refused_before_the_epochs(tmp_path: Path) -> None:
    done = _run(
        """
from mmcache.cli import main
sys.exit(main(["demo", "--n", "8", "--epochs", "1", "--workers", "0", "--size", "16",
               "--plot", "demo.png"]))
""",
        tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'mmcache[plot]'" in done.stderr
    assert "making" not in done.stdout  # refused before any data was made
    assert not (tmp_path / "demo.png").exists()


def test_demo_without_plot_runs_and_says_why_no_figure(tmp_path: Path) -> None:
    done = _run(
        """
from mmcache.cli import main
sys.exit(main(["demo", "--n", "16", "--epochs", "1", "--workers", "0", "--size", "16",
               "--batch-size", "8"]))
""",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "no plot:" in done.stdout and "pip install 'mmcache[plot]'" in done.stdout
    assert "samples/s" in done.stdout  # the table, the demo's result
    assert not (tmp_path / "mmcache-demo.png").exists()


def test_tier_shares_count_the_samples_waited_for() -> None:
    """The hit-rate panel's bars sum to the epoch's hit rate: the samples another process
    produced while this one waited (``waited``) are served, so they count in the
    denominator (they were left out, and the bars overstated the hit rate)."""
    from mmcache.plot import tier_shares
    from mmcache.stats import EpochStats

    epochs = [
        EpochStats(0, hits=0, misses=6, waited=2),
        EpochStats(1, hits=8, misses=0, waited=2, tier_hits={"memory": 6, "disk": 2}),
        EpochStats(2),
    ]
    shares = tier_shares(epochs)
    assert shares == {"disk": [0.0, 0.2, 0.0], "memory": [0.0, 0.6, 0.0]}
    for i, e in enumerate(epochs):
        assert sum(s[i] for s in shares.values()) == e.hit_rate
