"""Soak: three training jobs on one cache root under random faults, every batch checked.

    sudo env PYTHONPATH=src .venv/bin/python benchmarks/soak.py --minutes 3 --out soak.json

What it sets up, as root, in a mount namespace of its own (``unshare -m``, so the node's
real ``/dev/shm`` and disks are never filled):

* ``/dev/shm``: a 40 MiB tmpfs; the cache root (its disk tier) on a 3 MiB tmpfs;
* 600 synthetic images (:mod:`mmcache.synth`), 32 px cached, 16 tokens;
* 3 jobs on that root at once, each a DataLoader with 2 workers and a memory budget
  below the data (1.5 MiB for ~2 MiB), ``fallback="uncached"``; jobs 0 and 2 crop at
  random after the cache (crop processes), and each job has its own seed;
* each run of a job trains ``--epochs`` epochs (``benchmarks/soak_job.py``), logging a
  digest of every batch and saving ``state_dict()`` after it; a run that is killed or
  crashes is resumed from its last state (the exact-resume check), a finished one
  starts again from scratch.

Every batch is compared with an uncached reference run of its job. Faults come one at
a time, every ``--fault-every`` seconds on average, on a schedule drawn from ``--seed``
(``benchmarks/soak_faults.py``): kill -9 of a training process or of one of its
children (a worker or crop process), SIGSTOP of a child for 2-12 s, ``/dev/shm``
filled to < 300 KB free, the disk tier's file system filled, a memory hog (``--hog``).
Each filled file system is freed, and each hog ends, after 2-12 s.

After ``--minutes`` the faults stop and the jobs finish their runs (at most
``--drain-minutes``); then a warm epoch through the cache (hits and misses) and
``mmcache verify``. Reported (a table, and JSON with ``--out``): faults by kind, job
runs (finished / crashed / killed), epochs, batches checked and different, crashes by
signature (exception type and the innermost mmcache frame), and leaks: ``torch_*``
files in ``/dev/shm``, orphaned processes still alive 10 s after their run died,
leftovers in ``$TMPDIR``, memory stores beyond the one root's. Everything it made is
removed at the end (orphans are killed once counted).

Exit status: 0; 1 when a batch differs from the reference, an epoch came short, a
resume failed or ``verify`` found a bad entry (with ``--strict`` also for a crash or a
leak); 2 when it cannot run here (not root, no ``unshare``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from mmcache.units import parse_size
from soak_faults import KINDS, TAG, Faults, hog_bytes, rss_bytes, tagged
from soak_job import CRASHED, RESUME_FAILED, JobSpec, reference

HERE = Path(__file__).resolve().parent
INSIDE = "MMCACHE_SOAK_INSIDE"  # set in the copy of this script run in the namespace
SHM_SIZE, DISK_SIZE = "40m", "3m"
JOBS, WORKERS, BATCH = 3, 2, 16
ORPHAN_GRACE_S = 10.0  # how long a run's children may outlive it before they count


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=3.0, help="of faults (default 3)")
    p.add_argument("--seed", type=int, default=0, help="the data, the jobs' seeds, the faults")
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument("--epochs", type=int, default=8, help="per run (default 8)")
    p.add_argument("--images", type=int, default=600)
    p.add_argument("--memory", default="1536KiB", help="memory budget (below the data)")
    p.add_argument("--disk", default="2560KiB", help="disk budget (on a 3 MiB tmpfs)")
    p.add_argument("--fault-every", type=float, default=4.0, help="mean seconds between faults")
    p.add_argument("--hog", type=parse_size, help="e.g. 1GiB (default: 3 GiB or 1/4 of free)")
    p.add_argument("--step-ms", type=float, default=10.0, help="'training' per batch")
    p.add_argument("--drain-minutes", type=float, default=3.0)
    p.add_argument("--hang-s", type=float, default=120.0, help="no batch this long: a hang")
    p.add_argument("--strict", action="store_true", help="exit 1 on crashes and leaks too")
    return p.parse_args(argv)


def enter_namespace(argv: list[str]) -> int:
    """Run this script again as root in a private mount namespace (its own /dev/shm)."""
    if os.geteuid() != 0:
        print(
            "soak.py must run as root: it mounts a small /dev/shm and disk (tmpfs) in a "
            "mount namespace of its own (unshare -m); e.g. sudo env PYTHONPATH=src "
            ".venv/bin/python benchmarks/soak.py",
            file=sys.stderr,
        )
        return 2
    ns = ["unshare", "-m", "--propagation", "private"]
    tried = subprocess.run([*ns, "true"], capture_output=True, text=True, check=False)
    if shutil.which("unshare") is None or tried.returncode != 0:
        print(
            "soak.py needs a mount namespace (util-linux unshare -m, CAP_SYS_ADMIN): "
            f"{tried.stderr.strip() or 'unshare not found'}",
            file=sys.stderr,
        )
        return 2
    env = {**os.environ, INSIDE: "1"}
    return subprocess.run([*ns, sys.executable, __file__, *argv], env=env, check=False).returncode


def mount_tmpfs(path: str, size: str, mode: str) -> None:
    options = f"size={size},mode={mode}"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "soak", path], check=True)


@dataclasses.dataclass
class Tally:
    """What the jobs saw; one lock guards it (jobs are threads)."""

    runs: Counter[str] = dataclasses.field(default_factory=Counter)
    crashes: Counter[str] = dataclasses.field(default_factory=Counter)
    crash_tails: dict[str, str] = dataclasses.field(default_factory=dict)
    epochs: int = 0
    checked: int = 0
    different: int = 0
    short_epochs: int = 0
    resume_errors: int = 0
    orphans: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def check_log(path: str, want: dict[tuple[int, int], str]) -> tuple[set[tuple[int, int]], int]:
    """The batches a run logged (whole lines only: a line cut by a kill is replayed by
    the next run) and how many of them differ from ``want``."""
    seen, wrong = set(), 0
    with contextlib.suppress(FileNotFoundError), open(path) as fh:
        for line in fh:
            parts = line.split()
            if not line.endswith("\n") or len(parts) != 3:
                continue
            at = (int(parts[0]), int(parts[1]))
            seen.add(at)
            wrong += want.get(at) != parts[2]
    return seen, wrong


class Job(threading.Thread):
    """Runs one job's training processes one after another until the soak ends."""

    def __init__(self, soak: Soak, spec: JobSpec, want: dict[tuple[int, int], str]) -> None:
        super().__init__(name=f"job-{spec.job}", daemon=True)
        self.soak, self.spec, self.want = soak, spec, want
        self.pid: int | None = None
        self.count = 0
        self.last = {e: max(p for f, p in want if f == e) for e, _ in want}  # batches/epoch
        self.covered: set[tuple[int, int]] = set()  # batches since the last fresh start
        self.completed: set[int] = set()  # epochs since the last fresh start

    def run(self) -> None:
        soak, crashes_in_a_row = self.soak, 0
        while crashes_in_a_row < 20:
            outcome = self.one_run()
            if outcome == "unfinished at the end" or (
                outcome == "finished" and soak.faults_over.is_set()
            ):
                return
            crashes_in_a_row = crashes_in_a_row + 1 if outcome == "crashed" else 0
            if outcome == "crashed":
                time.sleep(1.0)
        with soak.tally.lock:
            soak.tally.runs["given up after 20 crashes in a row"] += 1

    def one_run(self) -> str:
        soak, tally = self.soak, self.soak.tally
        self.count += 1
        name = f"job{self.spec.job}-run{self.count}"
        spec = self.spec.with_files(soak.work / "logs", name)
        tag = f"{soak.id}:{name}"
        argv = [sys.executable, str(HERE / "soak_job.py"), "train", json.dumps(vars(spec))]
        with open(soak.work / "logs" / f"{name}.err", "wb") as err:
            proc = subprocess.Popen(argv, stdout=err, stderr=err, env={**soak.env, TAG: tag})
            self.pid = proc.pid
            ended = self.wait(proc, spec.log)
            self.pid = None
        threading.Timer(ORPHAN_GRACE_S, soak.count_orphans, (tag, name)).start()
        seen, wrong = check_log(spec.log, self.want)
        self.covered |= seen
        rc = proc.returncode
        if ended == "late":
            outcome = "unfinished at the end"
        elif rc == 0:
            outcome = "finished"
        elif rc == -signal.SIGKILL and proc.pid in soak.faults.killed and ended != "hung":
            outcome = "killed"
        else:
            outcome = "crashed"
        with tally.lock:
            tally.runs[outcome] += 1
            tally.checked += len(seen)
            tally.different += wrong
            ended_epochs = {e for e, p in seen if p == self.last[e]} - self.completed
            self.completed |= ended_epochs  # (a last batch replayed after a kill counts once)
            tally.epochs += len(ended_epochs)
            if outcome == "crashed":
                signature = self.signature(rc, ended == "hung", spec, proc.pid)
                tally.crashes[signature] += 1
                tally.crash_tails.setdefault(signature, _tail(soak.work / "logs" / f"{name}.err"))
            if rc == RESUME_FAILED:
                tally.resume_errors += 1
            if outcome == "finished":
                tally.short_epochs += sum(
                    any((e, p) not in self.covered for p in range(1, n + 1))
                    for e, n in self.last.items()
                )
        if outcome == "finished" or rc == RESUME_FAILED:
            self.covered, self.completed = set(), set()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(spec.state)  # the next run starts from scratch
        return outcome

    def wait(self, proc: subprocess.Popen[bytes], log: str) -> str:
        """Wait for the run to end (``"ended"``); kill it after ``--hang-s`` without a
        new batch (``"hung"``) or when the drain is over (``"late"``)."""
        size, since = -1, time.monotonic()
        while proc.poll() is None:
            time.sleep(0.5)
            now_size = os.path.getsize(log) if os.path.exists(log) else 0
            if now_size != size:
                size, since = now_size, time.monotonic()
            late = time.monotonic() > self.soak.drain_end
            if late or time.monotonic() - since > self.soak.args.hang_s:
                proc.kill()
                proc.wait()
                return "late" if late else "hung"
        return "ended"

    def signature(self, rc: int, hung: bool, spec: JobSpec, pid: int) -> str:
        if hung:
            return f"hang: no batch for {self.soak.args.hang_s:.0f} s"
        if rc in (CRASHED, RESUME_FAILED) and os.path.exists(spec.crash):
            with open(spec.crash) as fh:
                return str(json.load(fh)["signature"])
        if rc < 0:
            name = signal.Signals(-rc).name
            if -rc == signal.SIGKILL and pid not in self.soak.faults.killed:
                return "SIGKILL, not by the soak (the OOM killer?)"
            return f"killed by {name}"
        return f"exit status {rc}"


def _tail(path: Path, lines: int = 6) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    return ""


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.id = f"soak{os.getpid()}"
        self.work = Path(tempfile.mkdtemp(prefix="mmcache-soak-", dir="/tmp"))
        self.disk_mount = self.work / "disk"
        self.tally = Tally()
        self.faults_over = threading.Event()
        self.drain_end = float("inf")
        self.env = {
            **os.environ,
            "TMPDIR": str(self.work / "tmp"),
            "MMCACHE_IDENTITY_DIR": str(self.work / "identity"),  # not the user's ledger
            "PYTHONWARNINGS": "ignore",
        }
        self.final: dict[str, Any] = {}
        self.leaks: dict[str, Any] = {}
        self.jobs: list[Job] = []
        hog = args.hog if args.hog is not None else hog_bytes()
        self.faults = Faults(args.seed, self.running, "/dev/shm", str(self.disk_mount), hog)

    def running(self) -> list[int]:
        """The pids of the training processes running now."""
        return [pid for job in self.jobs if (pid := job.pid) is not None]

    def run(self) -> dict[str, Any]:
        try:
            specs = self.setup()
            print(f"soak: computing the uncached reference of {JOBS} jobs...", flush=True)
            wants = reference(specs)
            self.conduct(specs, wants)
            self.check_final(specs[0], wants[0])
            self.find_leaks()
        finally:
            self.cleanup()
        return self.report()

    def setup(self) -> list[JobSpec]:
        from mmcache.synth import make_dataset, synth_captions
        from mmcache.transforms import train_tokenizer

        a = self.args
        mount_tmpfs("/dev/shm", SHM_SIZE, "1777")
        self.disk_mount.mkdir()
        mount_tmpfs(str(self.disk_mount), DISK_SIZE, "0700")
        for sub in ("logs", "tmp", "identity"):
            (self.work / sub).mkdir()
        print(f"soak: {a.images} images and a tokenizer in {self.work}...", flush=True)
        manifest = make_dataset(self.work / "data", a.images, seed=a.seed, workers=2)
        tokenizer = self.work / "tokenizer.json"
        train_tokenizer(synth_captions(500, seed=a.seed), vocab_size=512).save(str(tokenizer))
        return [
            JobSpec(
                job=j, seed=a.seed * 1000 + j, crops=j != 1, manifest=str(manifest),
                tokenizer=str(tokenizer), root=str(self.disk_mount / "root"), memory=a.memory,
                disk=a.disk, epochs=a.epochs, batch_size=BATCH, workers=WORKERS,
                step_s=a.step_ms / 1000, state=str(self.work / f"state-{j}.json"), log="",
                crash="",
            )
            for j in range(JOBS)
        ]  # fmt: skip

    def conduct(self, specs: list[JobSpec], wants: list[dict[tuple[int, int], str]]) -> None:
        a = self.args
        self.jobs = jobs = [Job(self, spec, want) for spec, want in zip(specs, wants, strict=True)]
        end = time.monotonic() + a.minutes * 60
        self.drain_end = end + a.drain_minutes * 60
        print(f"soak: {JOBS} jobs, faults for {a.minutes:g} min (seed {a.seed})...", flush=True)
        for job in jobs:
            job.start()
        try:
            while (left := end - time.monotonic()) > 0:
                time.sleep(min(self.faults.delay(a.fault_every), left))
                if time.monotonic() < end:
                    self.faults.next()
        finally:
            self.faults_over.set()
            self.faults.close()
        print("soak: faults over; the jobs finish their runs...", flush=True)
        for job in jobs:
            job.join()
        time.sleep(ORPHAN_GRACE_S + 1)  # the last runs' orphan checks

    def count_orphans(self, tag: str, run: str, prefix: bool = False) -> None:
        """Count (and kill) what a run left alive (see ``ORPHAN_GRACE_S``)."""
        for proc in tagged(tag, prefix=prefix):
            found = {"run": run, "pid": proc.pid, "rss_mib": rss_bytes(proc.pid) / 2**20}
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            with self.tally.lock:
                self.tally.orphans.append(found)

    def check_final(self, spec: JobSpec, want: dict[tuple[int, int], str]) -> None:
        """A warm epoch through the cache (its hits and misses) and ``mmcache verify``."""
        spec = spec.with_files(self.work / "logs", "warm")
        argv = [sys.executable, str(HERE / "soak_job.py"), "warm", json.dumps(vars(spec))]
        done = subprocess.run(
            argv, capture_output=True, text=True, env=self.env, timeout=600, check=False
        )
        if done.returncode == 0:
            self.final["warm"] = json.loads(done.stdout.strip().splitlines()[-1])
        else:
            self.final["warm"] = {"failed": done.stderr.strip().splitlines()[-1:]}
        seen, wrong = check_log(spec.log, want)
        with self.tally.lock:
            self.tally.checked += len(seen)
            self.tally.different += wrong
        verify = [sys.executable, "-m", "mmcache.cli", "verify", "--cache", spec.root, "--json"]
        done = subprocess.run(
            verify, capture_output=True, text=True, env=self.env, timeout=600, check=False
        )
        try:
            got = json.loads(done.stdout)
            self.final["verify"] = {"checked": got["checked"], "bad": len(got["bad"]),
                                    "ok": got["ok"], "exit": done.returncode}  # fmt: skip
        except (ValueError, KeyError):
            self.final["verify"] = {"bad": None, "exit": done.returncode,
                                    "error": done.stderr.strip()[-300:]}  # fmt: skip

    def find_leaks(self) -> None:
        """After every run: whatever is still alive of them, ``torch_*`` files, $TMPDIR
        leftovers, and memory stores beyond the one of the jobs' root."""
        from mmcache.stores.memory import store_dir

        self.count_orphans(self.id, "any run (at the end)", prefix=True)
        stores = {Path(p).name[len("mmcache-") : -len("-meta")]
                  for p in glob.glob(f"{store_dir()}/mmcache-*-meta")}  # fmt: skip
        with self.tally.lock:
            orphans = list(self.tally.orphans)
        self.leaks = {
            "torch_shm_files": len(glob.glob("/dev/shm/torch_*")),
            "orphans": len(orphans),
            "orphans_rss_mib": round(sum(o["rss_mib"] for o in orphans), 1),
            "orphan_runs": sorted({o["run"] for o in orphans}),
            "tmpdir": sorted(os.listdir(self.work / "tmp")),
            "stores": len(stores),
            "leaked_stores": max(len(stores) - 1, 0),
        }

    def cleanup(self) -> None:
        self.faults.close()
        for proc in tagged(self.id, prefix=True):  # an interrupted soak's runs
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        for mount in (str(self.disk_mount), "/dev/shm"):  # namespace-private: gone anyway
            subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
        shutil.rmtree(self.work, ignore_errors=True)

    def report(self) -> dict[str, Any]:
        t, a = self.tally, self.args
        faults = {kind: self.faults.counts[kind] for kind in KINDS}
        return {
            "config": {k: v for k, v in vars(a).items() if k != "out"}
            | {"jobs": JOBS, "workers": WORKERS, "shm": SHM_SIZE, "disk_fs": DISK_SIZE},
            "faults": faults,
            "faults_total": sum(faults.values()),
            "runs": dict(t.runs),
            "epochs": t.epochs,
            "batches_checked": t.checked,
            "batches_different": t.different,
            "short_epochs": t.short_epochs,
            "resume_errors": t.resume_errors,
            "final": self.final,
            "crashes": dict(t.crashes.most_common()),
            "crash_tails": t.crash_tails,
            "leaks": self.leaks,
            "fault_log": self.faults.log,
        }


def wrong(result: dict[str, Any]) -> bool:
    verify = result["final"].get("verify", {})
    return bool(
        result["batches_different"] or result["short_epochs"] or result["resume_errors"]
        or verify.get("bad") != 0 or "failed" in result["final"].get("warm", {})
    )  # fmt: skip


def leaky(result: dict[str, Any]) -> bool:
    leaks = result["leaks"]
    return bool(result["crashes"] or leaks["torch_shm_files"] or leaks["orphans"]
                or leaks["tmpdir"] or leaks["leaked_stores"])  # fmt: skip


def table(result: dict[str, Any]) -> str:
    """The result as the rows of docs/reliability.md's soak table (markdown)."""
    runs, final, leaks = result["runs"], result["final"], result["leaks"]
    warm, verify = final.get("warm", {}), final.get("verify", {})
    kinds = ("finished", "crashed", "killed")
    finished, crashed, killed = (runs.get(k, 0) for k in kinds)
    others = "".join(f", {n} {k}" for k, n in runs.items() if k not in kinds)
    crashes = "; ".join(f"{n} x {s}" for s, n in result["crashes"].items()) or "0"
    rows = [
        *result["faults"].items(),
        ("**faults in all**", result["faults_total"]),
        ("job runs (finished / crashed / killed)",
         f"{sum(runs.values())} ({finished} / {crashed} / {killed}){others}"),
        ("epochs completed, batches checked", f"{result['epochs']}, {result['batches_checked']}"),
        ("**batches different from the uncached run**",
         f"**{result['batches_different']}** ({result['short_epochs']} short epochs, "
         f"{result['resume_errors']} resume errors)"),
        ("final run after all faults",
         f"warm: {warm.get('hits')} hits, {warm.get('misses')} misses; `verify`: "
         f"{verify.get('checked')} entries, {verify.get('bad')} bad"),
        ("crashes", crashes),
        ("leaks",
         f"{leaks.get('torch_shm_files')} `torch_*` files in /dev/shm; {leaks.get('orphans')} "
         f"orphaned processes ({leaks.get('orphans_rss_mib')} MiB RSS); "
         f"{len(leaks.get('tmpdir', []))} in $TMPDIR; {leaks.get('leaked_stores')} leaked "
         f"mmcache stores ({leaks.get('stores')} in all)"),
    ]  # fmt: skip
    return "\n".join(["| | count |", "|---|---:|", *(f"| {k} | {v} |" for k, v in rows)])


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if os.environ.get(INSIDE) != "1":
        return enter_namespace(argv)
    result = Soak(args).run()
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if wrong(result):
        print("soak: WRONG: a batch, an epoch, a resume or an entry was wrong", file=sys.stderr)
        return 1
    return 1 if args.strict and leaky(result) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
