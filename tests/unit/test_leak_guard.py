"""The suite's shared-memory leak guard (tests/conftest.py) blames only this run's stores.

A pytest run is started in a subprocess with the project's own conftest. While it
runs, two other "jobs" of the same user make memory tiers whose roots are outside
that run's temporary directory: one stays attached for the whole run, the other
finishes and its root disappears (as another test run's roots do). The guard must
report and remove the leak the run itself makes, and neither blame nor touch the
other jobs' stores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from mmcache.stores.memory.cleanup import store_owner, unlink_store

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

INNER_TESTS = """
import os, subprocess, sys, time
from pathlib import Path
from mmcache import Cache

OTHER = Path(os.environ["LEAK_GUARD_OTHER"])

def test_other_jobs_make_stores_meanwhile():
    # a job that stays attached until the outer test stops it
    # (each job writes its memory tier's name: named after its root's identity, it
    # cannot be known before the root is made, nor after it is removed)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from mmcache import Cache; "
        "c = Cache(sys.argv[1], memory='1MiB'); open(sys.argv[1] + '.name', 'w').write("
        "c.memory_name); open(sys.argv[2], 'w').close(); "
        "time.sleep(600)"), str(OTHER / "live"), str(OTHER / "ready")])
    (OTHER / "holder.pid").write_text(str(holder.pid))
    # a job that finished and whose root is gone (another run's temporary folder)
    subprocess.run([sys.executable, "-c", (
        "import shutil, sys; from mmcache import Cache; c = Cache(sys.argv[1], memory='1MiB');"
        " open(sys.argv[1] + '.name', 'w').write(c.memory_name); c.close();"
        " shutil.rmtree(sys.argv[1])"),
        str(OTHER / "gone")], check=True)
    deadline = time.monotonic() + 120
    while not (OTHER / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (OTHER / "ready").exists()

def test_leaks_its_own_tier(tmp_path):
    c = Cache(tmp_path / "mine", memory="1MiB")
    (OTHER / "mine.name").write_text(c.memory_name)
    c.close()
"""


def test_guard_blames_only_stores_under_its_own_temporary_directory(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST.read_text())
    (suite / "test_inner.py").write_text(textwrap.dedent(INNER_TESTS))
    other = tmp_path / "other-jobs"
    other.mkdir()
    inner_tmp = tmp_path / "inner-tmp"
    names: dict[str, str] = {}
    env = {**os.environ, "LEAK_GUARD_OTHER": str(other), "MMCACHE_TEST_SHM_STRICT": "1"}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
             f"--basetemp={inner_tmp}", "-o", "addopts=", str(suite)],
            cwd=suite, env=env, capture_output=True, text=True, timeout=280, check=False,
        )  # fmt: skip
        names = {job: (other / f"{job}.name").read_text() for job in ("live", "gone", "mine")}
        out = proc.stdout + proc.stderr
        assert "2 passed" in out, out
        # the run's own leak is reported (so strict mode fails it) and removed
        assert "left behind by tests" in out, out
        assert names["mine"] in out, out
        assert proc.returncode == 1, out
        assert store_owner(names["mine"]) is None
        # the other jobs' stores are neither blamed nor removed
        for job in ("live", "gone"):
            assert names[job] not in out, out
            assert store_owner(names[job]) == str((other / job).absolute())
    finally:
        pid_file = other / "holder.pid"
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        for name in names.values():
            unlink_store(name)
