"""Run ``loader_jobs.py`` commands, in a private mount namespace with a small /dev/shm.

``unshare -m`` gives the command its own mount table, where a tmpfs of the size asked
for is mounted over ``/dev/shm``: the command (and every process it starts) fills
that one, never the machine's, and the mount goes with its last process.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

JOBS = Path(__file__).with_name("loader_jobs.py")


@functools.cache
def private_shm_problem() -> str | None:
    """Why a private /dev/shm cannot be had here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a private /dev/shm needs root (unshare -m and mount)"
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux)"
    probe = subprocess.run(
        [*_private(1 << 20), "true"], capture_output=True, text=True, check=False, timeout=30
    )
    if probe.returncode != 0:
        return f"unshare -m / mount tmpfs not permitted here: {probe.stderr.strip()}"
    return None


def _private(size: int) -> list[str]:
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]


def run_job(*args: str, shm: int | None = None, timeout: float = 300) -> dict[str, Any]:
    """Run ``loader_jobs.py ARGS`` (in a private /dev/shm of ``shm`` bytes, or skip the
    test where there can be none) and return its JSON result."""
    prefix: list[str] = []
    if shm is not None:
        problem = private_shm_problem()
        if problem is not None:
            pytest.skip(problem)
        prefix = _private(shm)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [*prefix, sys.executable, str(JOBS), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        env=env,
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, (
        f"loader_jobs.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    )
    result: dict[str, Any] = json.loads(lines[-1])
    return result
