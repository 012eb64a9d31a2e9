"""The soak's faults (``benchmarks/soak.py``) and what it reads of the process table.

:class:`Faults` injects one fault at a time on a seeded schedule (:meth:`Faults.next`):
the kind and the delays come from ``random.Random(seed)``, the targets from what runs
at that moment. The faults that last (a stopped process, a filled file system, a
memory hog) end on a timer; :meth:`Faults.close` ends every one still on.

Processes are found in ``/proc``: a run's children by their parent pid, and whatever
a run started (forked workers and crop processes, spawned helpers) by the variable
:data:`TAG` in its environment, which every descendant inherits, so that those still
alive after their run died are found wherever they were reparented.

Thread-safety: :class:`Faults` is used from the soak's main thread only; its timers
touch only the state they were given.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

TAG = "MMCACHE_SOAK_RUN"  # "<soak id>:<job>-<run>" in a run's environment
KINDS = {  # kind: weight (the mix of the first soaks: kills, fills, hogs, a few stops)
    "kill -9 of a training process": 4,
    "kill -9 of a child (worker or crop process)": 3,
    "SIGSTOP of a child for 2-12 s": 2,
    "/dev/shm filled to < 300 KB free": 4,
    "disk filesystem filled": 3,
    "memory hog": 2,
}
SHM_LEFT = 256 * 1024  # what a /dev/shm fill leaves free


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str  # R, S, D, T (stopped), Z (zombie)...
    cmdline: str


def processes() -> dict[int, Proc]:
    """Every process of the node now (those that vanish while read are left out)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        out[int(entry)] = Proc(int(entry), int(fields[1]), fields[0], cmdline)
    return out


def tagged(tag: str, *, prefix: bool = False) -> list[Proc]:
    """The live (not zombie) processes whose environment holds ``TAG=tag`` (with
    ``prefix``: a value that starts with ``tag``)."""
    needle = f"{TAG}={tag}{'' if prefix else chr(0)}".encode()
    found = []
    for proc in processes().values():
        if proc.state == "Z":
            continue
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as fh:
                if needle in fh.read():
                    found.append(proc)
        except OSError:
            continue
    return found


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def fill(folder: str, leave: int) -> tuple[str, int]:
    """Take all but ``leave`` bytes of the file system of ``folder`` with one file
    (``folder/soak-fill-*``); return its path and the bytes free after it."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    path = os.path.join(folder, f"soak-fill-{os.getpid()}-{time.monotonic_ns()}")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
    try:
        size = free - leave
        while size > 0:  # others allocate meanwhile: take a little less each try
            try:
                os.posix_fallocate(fd, 0, size)
                break
            except OSError:
                size -= max(size // 8, 4096)
    finally:
        os.close(fd)
    st = os.statvfs(folder)
    return path, st.f_bavail * st.f_frsize


def hog_bytes() -> int:
    """The memory hog's default size: 3 GiB, or a quarter of the memory available."""
    with open("/proc/meminfo") as fh:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh}
    return min(3 << 30, info.get("MemAvailable", 0) // 4)


_HOG = (  # touches every page: the memory is really taken
    "import sys, time, numpy; a = numpy.ones(int(sys.argv[1]), numpy.uint8); "
    "time.sleep(float(sys.argv[2]))"
)


class Faults:
    """Injects the soak's faults (see the module docstring) and counts them by kind.

    ``runs()`` says which training processes run now (their pids); ``shm`` and
    ``disk`` are the folders whose file systems the fills take.
    """

    def __init__(
        self, seed: int, runs: Callable[[], list[int]], shm: str, disk: str, hog: int
    ) -> None:
        self.rng = random.Random(seed)
        self.runs, self.shm, self.disk, self.hog = runs, shm, disk, hog
        self.counts: Counter[str] = Counter()
        self.killed: set[int] = set()  # training processes this soak killed
        self.log: list[str] = []
        self._timers: list[threading.Timer] = []
        self._stopped: set[int] = set()
        self._fills: list[str] = []
        self._hogs: list[subprocess.Popen[bytes]] = []

    def delay(self, mean: float) -> float:
        return self.rng.uniform(0.5 * mean, 1.5 * mean)

    def next(self) -> None:
        """Inject one fault of a kind drawn from :data:`KINDS` (a kind with no target
        now, a child when no run has one, is drawn again, at most 10 times)."""
        kinds, weights = list(KINDS), list(KINDS.values())
        for _ in range(10):
            kind = self.rng.choices(kinds, weights)[0]
            what = self._inject(kind, self.rng.uniform(2, 12))
            if what is not None:
                self.counts[kind] += 1
                self.log.append(f"{time.strftime('%H:%M:%S')} {kind}: {what}")
                return

    def _inject(self, kind: str, seconds: float) -> str | None:
        pids = self.runs()
        if kind == "kill -9 of a training process":
            if not pids:
                return None
            pid = self.rng.choice(pids)
            self.killed.add(pid)
            return _signal(pid, signal.SIGKILL)
        if kind.startswith(("kill -9 of a child", "SIGSTOP")):
            table = processes()
            children = [
                p.pid
                for p in table.values()
                if p.ppid in pids and p.state != "Z" and "resource_tracker" not in p.cmdline
            ]
            if not children:
                return None
            pid = self.rng.choice(sorted(children))
            if kind.startswith("kill"):
                return _signal(pid, signal.SIGKILL)
            self._stopped.add(pid)
            self._later(seconds, lambda: self._resume(pid))
            return f"{_signal(pid, signal.SIGSTOP)} for {seconds:.0f} s"
        if kind == "memory hog":
            self._hogs.append(
                subprocess.Popen([sys.executable, "-c", _HOG, str(self.hog), str(seconds)])
            )
            return f"{self.hog >> 20} MiB for {seconds:.0f} s"
        folder = self.shm if kind.startswith("/dev/shm") else self.disk
        path, free = fill(folder, SHM_LEFT if folder == self.shm else 0)
        self._fills.append(path)
        self._later(seconds, lambda: _remove(path))
        return f"{free >> 10} KiB left for {seconds:.0f} s"

    def _later(self, seconds: float, fn: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, fn)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def _resume(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    def close(self) -> None:
        """End every fault still on: continue the stopped, free the fills, end the hogs."""
        for timer in self._timers:
            timer.cancel()
        for pid in self._stopped:
            self._resume(pid)
        for path in self._fills:
            _remove(path)
        for hog in self._hogs:
            if hog.poll() is None:
                hog.kill()
            hog.wait()


def _signal(pid: int, sig: signal.Signals) -> str:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return f"{sig.name} to {pid}, which was gone"
    return f"{sig.name} to {pid}"


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
