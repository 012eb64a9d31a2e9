"""How mmcache's control plane grows with N (issue 41): JSONL, Parquet and WebDataset of tiny
samples at N = 10^4 and 10^5 (10^6 with ``--big``), each measure per sample.

The scale study's method (``research/scale-turn4.md``) as one command: tiny samples (32x32
JPEGs, ~100-character captions; :mod:`scale_data`) so the bytes do not hide the control
plane; CPU time (the process's rusage + its live children's + the reaped ones') and bytes,
which the other load of a shared machine disturbs little, are the figures to trust; wall
times are secondary. Each phase runs in a fresh process:

- ``first``: open the source (first time: no member index, no ledger), ``Cache``,
  ``DataLoader``, a cold epoch, two warm ones; the memory of every process (psutil USS =
  private, PSS, RSS - USS = shared); the memory tier's bytes per entry (its /dev/shm
  files' blocks, index included) and LMDB's (``data.mdb``'s blocks); the freshness check:
  ``source.stamps`` over every sample, and a warm epoch with a ``stat`` latency injected
  (``--stat-latency-ms``, default 0.5, a network file system's: a wrapper over
  ``os.stat`` in this process, inherited by the forked workers and stat prefetcher);
- ``second``: a new process over the filled cache: open (a later start), ``Cache``,
  ``DataLoader`` and its first batch (the time to first batch, from after the imports),
  the rest of that epoch, and the memory again.

``--opens-only`` measures only the opens (first and later, ``--repeat`` times, median): what
a change of the open path is compared with, old and new sources taken in turns.
``--freshness-only`` measures only the per-epoch file check of the JSONL source under the
injected ``stat`` latency: two epochs of ``stamps`` for each way of checking the imported
mmcache offers (the default, ``recheck=600``, ``freshness="run"``), with the stats issued;
``--sweep-limit`` bounds the samples per epoch (an old, serial check at 10^6 takes an hour).
``--freshness``/``--recheck`` open the JSONL source of the full phases with those options.

    PYTHONPATH=src python benchmarks/scale.py [--n 10000,100000] [--big] [--sources wds]

Prints a markdown table and writes ``benchmarks/results/scale.json`` (and ``scale.md``), with
the commit, machine and load average. Datasets and cache roots are kept under
``benchmarks/results/scale/`` (``--work``) and reused.
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import scale_data  # noqa: E402

RESULTS = HERE / "results"
ME = psutil.Process()

# -- the injected stat latency ------------------------------------------------------------
#: Seconds each ``os.stat`` sleeps first (0: none); shared memory, so that the forked
#: workers and stat prefetcher, which inherit the wrapper, see it turned on and off.
_STAT_DELAY = multiprocessing.RawValue("d", 0.0)
_real_stat = os.stat


#: Wrapped stats slept in this process (``--freshness-only`` counts what a sweep issued).
_SLEPT = [0]
_SLEPT_LOCK = threading.Lock()


def _slow_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
    delay = _STAT_DELAY.value
    if delay:
        with _SLEPT_LOCK:
            _SLEPT[0] += 1
        time.sleep(delay)
    return _real_stat(path, *args, **kwargs)


# -- CPU and memory -----------------------------------------------------------------------
def snap() -> dict[str, Any]:
    """Wall clock, this process's CPU, its reaped children's and each live descendant's."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    live: dict[int, float] = {}
    for child in ME.children(recursive=True):
        try:
            t = child.cpu_times()
            live[child.pid] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return {
        "t": time.perf_counter(),
        "self": own.ru_utime + own.ru_stime,
        "reaped": reaped.ru_utime + reaped.ru_stime,
        "live": live,
    }


def delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    children = b["reaped"] - a["reaped"] + sum(b["live"].values()) - sum(a["live"].values())
    own = b["self"] - a["self"]
    return {"wall": b["t"] - a["t"], "self_cpu": own, "cpu": own + children}


def timed(fn: Any) -> tuple[Any, dict[str, float]]:
    a = snap()
    value = fn()
    return value, delta(a, snap())


def meminfo(pid: int) -> dict[str, int]:
    try:
        m = psutil.Process(pid).memory_full_info()
    except psutil.Error:
        return {}
    out = {"rss": m.rss, "uss": m.uss, "pss": m.pss, "shared": m.rss - m.uss}
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == "Anonymous":
                    out["anonymous"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def prefetcher_pid(loader: Any) -> int | None:
    """The stat prefetcher's pid (a private field: ``None`` where the loader has none)."""
    try:
        return int(loader._warm._prefetcher.pid)
    except (AttributeError, TypeError):
        return None


def memory(loader: Any) -> dict[str, Any]:
    """USS/PSS/RSS of the training process, each worker and the stat prefetcher."""
    pf = prefetcher_pid(loader)
    out: dict[str, Any] = {"main": meminfo(os.getpid()), "workers": [], "prefetcher": None}
    for child in ME.children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if child.pid == pf:
            out["prefetcher"] = meminfo(child.pid)
        elif "resource_tracker" not in cmd and "semaphore_tracker" not in cmd:
            out["workers"].append(meminfo(child.pid))
    return out


# -- one phase ----------------------------------------------------------------------------
class Phase:
    """One (source, N) in this process: the dataset, its cache root and ledger."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.n: int = args.n
        self.source: str = args.source
        self.work = Path(args.work)
        self.data = scale_data.ensure(self.work / "data", self.source, self.n)
        self.tok = scale_data.tokenizer(self.work / "data")
        self.root = self.work / "roots" / f"{self.source}-{self.n}"
        self.ledger = self.work / "ident" / f"{self.source}-{self.n}"
        self.columns = self.work / "columns" / f"{self.source}-{self.n}"

    def pipeline(self) -> Any:
        import mmcache as mc

        return mc.Pipeline(image=mc.ImageSpec(size=16), text=mc.TextSpec(self.tok, max_length=16))

    def open_source(self) -> Any:
        import mmcache as mc
        from mmcache.sources import WebDatasetSource

        pipe = self.pipeline()
        if self.source == "jsonl":
            fresh: dict[str, Any] = {}  # given only when set (an older mmcache has neither)
            if self.args.freshness != "epoch":
                fresh["freshness"] = self.args.freshness
            if self.args.recheck:
                fresh["recheck"] = self.args.recheck
            return mc.MultimodalDataset(self.data / "manifest.jsonl", pipeline=pipe, **fresh)
        if self.source == "parquet":
            columns = {"id": "id", "image": "image", "text": "text"}
            return mc.open_source(self.data, pipeline=pipe, format="parquet", columns=columns)
        return WebDatasetSource(
            str(self.data / "*.tar"), pipeline=pipe, index_dir=self.root / "wds-index"
        )

    def cache(self) -> Any:
        import mmcache as mc

        # every entry fits in memory; the disk tier holds them all too
        return mc.Cache(
            self.root, memory=max(256 << 20, self.n * 3072), disk=max(1 << 30, self.n * 6144)
        )

    def loader(self, src: Any, cache: Any) -> Any:
        import mmcache as mc

        return mc.DataLoader(
            src,
            cache=cache,
            batch_size=self.args.batch,
            shuffle=True,
            seed=0,
            num_workers=self.args.workers,
            persistent_workers=True,
        )

    def forget(self) -> None:
        """Remove the cache root, its memory tier and the identity ledger: a first run."""
        if self.root.exists():
            cache = self.cache()
            if cache.memory is not None:
                cache.memory.unlink()
            cache.close()
            shutil.rmtree(self.root)
        shutil.rmtree(self.ledger, ignore_errors=True)
        self.ledger.mkdir(parents=True)
        shutil.rmtree(self.columns, ignore_errors=True)  # a manifest's columns: built again

    def epoch(self, loader: Any, number: int) -> dict[str, Any]:
        loader.set_epoch(number)
        a = snap()
        first = None
        samples = 0
        for batch in loader:
            if first is None:
                first = time.perf_counter() - a["t"]
            samples += len(batch["id"])
        out: dict[str, Any] = {**delta(a, snap()), "samples": samples, "first_batch_s": first}
        try:
            stats = loader.stats().epochs[-1]
            out["hits"], out["misses"] = stats.hits, stats.misses
        except (AttributeError, IndexError):
            pass
        return out

    def stamps_sweep(self, src: Any) -> dict[str, float]:
        """``src.stamps`` over every sample in batch-sized calls: the per-epoch check's work."""
        idx = np.arange(len(src), dtype=np.int64)
        a = snap()
        for s in range(0, len(idx), self.args.batch):
            src.stamps(idx[s : s + self.args.batch])
        return delta(a, snap())

    def tier_bytes(self, cache: Any) -> dict[str, float]:
        stats = cache.stats()
        out: dict[str, float] = {}
        mem = stats.tiers.get("memory")
        if mem is not None and mem.items:
            out["shm_bytes_per_entry"] = cache.memory.resident_bytes() / mem.items
            out["memory_items"] = mem.items
        disk = stats.tiers.get("disk")
        data_mdb = self.root / "disk" / "data.mdb"
        if disk is not None and disk.items and data_mdb.exists():
            out["lmdb_bytes_per_entry"] = data_mdb.stat().st_blocks * 512 / disk.items
            out["disk_items"] = disk.items
        return out

    def first(self) -> dict[str, Any]:
        self.forget()
        r: dict[str, Any] = {"memory_before": meminfo(os.getpid())}  # imports done, no source
        src, r["open_first"] = timed(self.open_source)
        r["memory_open"] = meminfo(os.getpid())
        r["len"] = len(src)
        cache = self.cache()
        loader = self.loader(src, cache)
        r["epoch_cold"] = self.epoch(loader, 0)
        r["epoch_warm1"] = self.epoch(loader, 1)
        r["epoch_warm2"] = self.epoch(loader, 2)
        r["memory_warm"] = memory(loader)
        r["tiers"] = self.tier_bytes(cache)
        r["stamps_local"] = self.stamps_sweep(src)
        if self.args.stat_latency_ms > 0:
            _STAT_DELAY.value = self.args.stat_latency_ms / 1000
            try:
                # what one wrapped stat really takes here (a sleep overshoots under load)
                calls = 200
                a = snap()
                for _ in range(calls):
                    os.stat(self.root)
                r["stat_latency_s"] = delta(a, snap())["wall"] / calls
                r["epoch_slow_stat"] = self.epoch(loader, 3)
            finally:
                _STAT_DELAY.value = 0.0
        loader.close()
        cache.close()
        return r

    def second(self) -> dict[str, Any]:
        r: dict[str, Any] = {"memory_before": meminfo(os.getpid())}
        a = snap()
        src, r["open_later"] = timed(self.open_source)
        r["memory_open"] = meminfo(os.getpid())
        cache = self.cache()
        loader = self.loader(src, cache)
        loader.set_epoch(4)
        it = iter(loader)
        batch = next(it)
        r["first_batch"] = delta(a, snap())
        samples = len(batch["id"]) + sum(len(b["id"]) for b in it)
        r["epoch_new_process"] = {**delta(a, snap()), "samples": samples}
        r["memory_new_process"] = memory(loader)
        loader.close()
        cache.close()
        return r

    def freshness(self) -> dict[str, Any]:
        """The per-epoch file check under the injected ``stat`` latency (JSONL): two
        epochs of ``stamps`` over a shuffled order in batch-sized calls (as the stat
        prefetcher makes them), for each way of checking the mmcache imported offers
        (``freshness``/``recheck`` where it has them), with the stats each issued; at most
        ``--sweep-limit`` samples per epoch (the cost is linear: per sample is the figure).
        The path table is built before the clock starts (not a stat)."""
        import mmcache as mc

        modes: dict[str, dict[str, Any]] = {"epoch (default)": {}}
        if "freshness" in inspect.signature(mc.MultimodalDataset.__init__).parameters:
            modes["recheck=600"] = {"recheck": 600.0}
            modes["run"] = {"freshness": "run"}
        order = np.random.default_rng(0).permutation(self.n)[: self.args.sweep_limit or None]
        out: dict[str, Any] = {"swept": len(order), "modes": {}}
        _STAT_DELAY.value = self.args.stat_latency_ms / 1000
        try:
            calls = 200
            a = snap()
            for _ in range(calls):
                os.stat(self.data)
            out["stat_latency_s"] = delta(a, snap())["wall"] / calls
            for name, options in modes.items():
                src = mc.MultimodalDataset(
                    self.data / "manifest.jsonl", pipeline=self.pipeline(), **options
                )
                src.records.stat_paths(order[:1])  # the path table, built once per process
                epochs = []
                for _ in range(2):
                    slept = _SLEPT[0]
                    a = snap()
                    for s in range(0, len(order), self.args.batch):
                        src.stamps(order[s : s + self.args.batch])
                    epochs.append({**delta(a, snap()), "stats": _SLEPT[0] - slept})
                out["modes"][name] = epochs
        finally:
            _STAT_DELAY.value = 0.0
        return out

    def opens(self) -> dict[str, Any]:
        """First and later opens only, ``--repeat`` times: the index (and ledger) removed
        before each first open."""
        firsts, laters = [], []
        for _ in range(self.args.repeat):
            shutil.rmtree(self.root / "wds-index", ignore_errors=True)
            shutil.rmtree(self.columns, ignore_errors=True)
            src, t = timed(self.open_source)
            firsts.append(t)
            del src
            src, t = timed(self.open_source)
            laters.append(t)
            del src
        pick = statistics.median
        return {
            "len": self.n,
            "open_first": {k: pick(t[k] for t in firsts) for k in firsts[0]},
            "open_later": {k: pick(t[k] for t in laters) for k in laters[0]},
            "open_first_all": firsts,
            "open_later_all": laters,
        }


def run_phase(args: argparse.Namespace) -> None:
    os.environ["MMCACHE_IDENTITY_DIR"] = str(Path(args.work) / "ident" / f"{args.source}-{args.n}")
    os.environ["MMCACHE_COLUMNS_DIR"] = str(Path(args.work) / "columns" / f"{args.source}-{args.n}")
    os.stat = _slow_stat  # off until _STAT_DELAY is set
    a = snap()
    import torch  # noqa: F401

    import mmcache  # noqa: F401

    phase = Phase(args)
    result = {"import": delta(a, snap()), **getattr(phase, args.phase)()}
    Path(args.result).write_text(json.dumps(result, indent=1, default=str))


# -- the driver ---------------------------------------------------------------------------
def source_commit() -> tuple[str, str]:
    """Where the mmcache the phases import lives (``PYTHONPATH`` decides), and the commit
    of the git checkout holding it (``+changes`` when its sources differ; ``?``: none)."""
    found = subprocess.run(
        [sys.executable, "-c", "import mmcache, os; print(os.path.dirname(mmcache.__file__))"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    where = found or str(HERE)

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=where, capture_output=True, text=True, check=False
        )
        return done.stdout.strip()

    try:
        commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", ".")
    except OSError:
        return found, "?"
    return found, (commit + ("+changes" if dirty else "")) if commit else "?"


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    where, commit = source_commit()
    return {
        "commit": commit,
        "mmcache": where,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
    }


def run_child(args: argparse.Namespace, phase: str, source: str, n: int) -> dict[str, Any]:
    out = Path(args.work) / "phase.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--phase", phase, "--source", source, "--n", str(n)]
    cmd += ["--work", args.work, "--result", str(out), "--batch", str(args.batch)]
    cmd += ["--workers", str(args.workers), "--stat-latency-ms", str(args.stat_latency_ms)]
    cmd += ["--repeat", str(args.repeat), "--sweep-limit", str(args.sweep_limit)]
    cmd += ["--freshness", args.freshness, "--recheck", str(args.recheck)]
    print(f"== {source} N={n:,} {phase} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def us(seconds: float, n: int) -> str:
    """Seconds over ``n`` samples as microseconds per sample."""
    return f"{1e6 * seconds / n:,.1f}"


def per(value: float, n: int) -> str:
    """Bytes over ``n`` samples as bytes per sample."""
    return f"{value / n:,.0f}"


def mb(value: float) -> str:
    return f"{value / 1e6:,.1f}"


def _worker(r: dict[str, Any], what: str) -> float:
    return float(max(w[what] for w in r["first"]["memory_warm"]["workers"]))


def _main_mem(r: dict[str, Any]) -> str:
    m = r["first"]["memory_warm"]["main"]
    return f"{mb(m['uss'])} / {mb(m['pss'])} / {mb(m['shared'])}"


def _first_batch(r: dict[str, Any]) -> str:
    fb = r["second"]["first_batch"]
    return f"{fb['wall']:.2f} / {fb['cpu']:.2f}"


def _warm(r: dict[str, Any]) -> str:
    one, two = r["first"]["epoch_warm1"]["cpu"], r["first"]["epoch_warm2"]["cpu"]
    return f"{us(one, r['n'])} / {us(two, r['n'])}"


def _slow_epoch(r: dict[str, Any]) -> str:
    wall = r["first"]["epoch_slow_stat"]["wall"]
    return f"{wall:.1f} / {us(wall, r['n'])}"


def _new_heap(r: dict[str, Any]) -> str:
    m = r["second"]["memory_new_process"]["main"]
    return f"{mb(m['uss'])} / {mb(m['anonymous'])}"


def _growth(phase: str, after: str, what: str) -> Any:
    """A cell: how much the training process's ``what`` (``uss``, ``anonymous``) grew from
    before the source was opened to ``after``, per sample (its private memory per record,
    the imports' and the interpreter's left out)."""

    def cell(r: dict[str, Any]) -> str:
        before = r[phase]["memory_before"][what]
        now = r[phase][after]  # meminfo, or memory(): the training process's under "main"
        now = now["main"][what] if "main" in now else now[what]
        return per(now - before, r["n"])

    return cell


def dig(r: dict[str, Any], path: str) -> Any:
    """``r["a"]["b"]`` of ``path`` ``"a.b"``."""
    for part in path.split("."):
        r = r[part]
    return r


def us_of(path: str) -> Any:
    """A cell: the seconds at ``path`` as microseconds per sample."""
    return lambda r: us(dig(r, path), r["n"])


def per_of(path: str) -> Any:
    """A cell: the bytes at ``path`` per sample."""
    return lambda r: per(dig(r, path), r["n"])


def whole(path: str) -> Any:
    """A cell: the number at ``path``, rounded."""
    return lambda r: f"{dig(r, path):,.0f}"


OPEN_ROWS: list[tuple[str, Any]] = [
    ("open CPU, first time (us/sample)", us_of("open.open_first.cpu")),
    ("open wall, first time (s)", lambda r: f"{r['open']['open_first']['wall']:.2f}"),
    ("open CPU, later start (us/sample)", us_of("open.open_later.cpu")),
]
RUN_ROWS: list[tuple[str, Any]] = [
    ("new process: time to first batch (s wall / s CPU)", _first_batch),
    ("cold epoch CPU (us/sample)", us_of("first.epoch_cold.cpu")),
    ("  of which training process", us_of("first.epoch_cold.self_cpu")),
    ("warm epoch CPU, 1st / 2nd (us/sample)", _warm),
    ("new process's epoch CPU (us/sample)", us_of("second.epoch_new_process.cpu")),
    ("freshness: stamps() CPU, local (us/sample)", us_of("first.stamps_local.self_cpu")),
    ("freshness: warm epoch wall, slow stat (s / us per sample)", _slow_epoch),
    ("  one wrapped stat measured (ms)", lambda r: f"{1e3 * r['first']['stat_latency_s']:.2f}"),
    ("main USS / PSS / shared after warm (MB)", _main_mem),
    ("main USS after warm (B/sample)", per_of("first.memory_warm.main.uss")),
    (
        "main USS growth: open / after cold + 2 warm (B/sample)",
        lambda r: (
            f"{_growth('first', 'memory_open', 'uss')(r)}"
            f" / {_growth('first', 'memory_warm', 'uss')(r)}"
        ),
    ),
    (
        "main heap growth: open / after cold + 2 warm (B/sample)",
        lambda r: (
            f"{_growth('first', 'memory_open', 'anonymous')(r)}"
            f" / {_growth('first', 'memory_warm', 'anonymous')(r)}"
        ),
    ),
    (
        "new process: main USS / heap growth after its epoch (B/sample)",
        lambda r: (
            f"{_growth('second', 'memory_new_process', 'uss')(r)}"
            f" / {_growth('second', 'memory_new_process', 'anonymous')(r)}"
        ),
    ),
    (
        "main heap (Anonymous) after warm (MB)",
        lambda r: mb(dig(r, "first.memory_warm.main.anonymous")),
    ),
    ("worker USS / PSS, max (MB)", lambda r: f"{mb(_worker(r, 'uss'))} / {mb(_worker(r, 'pss'))}"),
    ("worker USS (B/sample)", lambda r: per(_worker(r, "uss"), r["n"])),
    ("prefetcher USS (MB)", lambda r: mb(dig(r, "first.memory_warm.prefetcher.uss"))),
    ("new process: main USS / heap (MB)", _new_heap),
    ("memory tier /dev/shm (B/entry)", whole("first.tiers.shm_bytes_per_entry")),
    ("LMDB data.mdb (B/entry)", whole("first.tiers.lmdb_bytes_per_entry")),
]


def _fresh_epoch(mode: str, epoch: int) -> Any:
    """A cell: one freshness epoch's wall for all N samples (measured over ``swept``:
    linear), per sample, and the stats it issued per sample."""

    def cell(r: dict[str, Any]) -> str:
        f = r["freshness"]
        got = f["modes"][mode][epoch]
        n, swept = r["n"], f["swept"]
        wall = got["wall"] * n / swept
        return f"{wall:,.1f} s ({us(got['wall'], swept)} us; {got['stats'] / swept:.2f} stats)"

    return cell


def freshness_rows(runs: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
    """``--freshness-only``'s rows: each mode's two epochs, and the stat measured."""
    modes: list[str] = []
    for r in runs.values():
        modes += [m for m in r.get("freshness", {}).get("modes", {}) if m not in modes]
    if not modes:
        return []
    rows: list[tuple[str, Any]] = [
        ("freshness: one wrapped stat (ms)", whole_ms("freshness.stat_latency_s"))
    ]
    for mode in modes:
        for epoch in (0, 1):
            rows.append(
                (f"freshness {mode}, epoch {epoch + 1}: s per epoch", _fresh_epoch(mode, epoch))
            )
    return rows


def whole_ms(path: str) -> Any:
    """A cell: the seconds at ``path`` in milliseconds."""
    return lambda r: f"{1e3 * dig(r, path):.2f}"


def table(runs: dict[str, dict[str, Any]]) -> str:
    """The markdown table: one row per measure, one column per (source, N); ``-`` where a
    run has no such figure (a source without a stat prefetcher, ``--opens-only``)."""
    cols = list(runs)
    rows = OPEN_ROWS if any("open" in r for r in runs.values()) else []
    rows += RUN_ROWS if any("first" in r for r in runs.values()) else []
    rows += freshness_rows(runs)
    lines = ["| measure | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, cell in rows:
        cells = []
        for c in cols:
            try:
                cells.append(cell(runs[c]))
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                cells.append("-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def slopes(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Private memory per extra sample between the smallest and largest N of each source."""
    out = []
    for source in scale_data.KINDS:
        mine = sorted((r["n"], r) for r in runs.values() if r["source"] == source and "first" in r)
        if len(mine) < 2:
            continue
        (n0, r0), (n1, r1) = mine[0], mine[-1]
        for who in ("main", "prefetcher"):
            a, b = r0["first"]["memory_warm"][who], r1["first"]["memory_warm"][who]
            if a and b:
                slope = (b["uss"] - a["uss"]) / (n1 - n0)
                out.append(f"{source} {who} USS slope {n0:,} -> {n1:,}: {slope:,.0f} B/sample")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="10000,100000", help="comma-separated sample counts")
    ap.add_argument("--big", action="store_true", help="add N = 10^6 (tens of minutes)")
    ap.add_argument("--sources", default=",".join(scale_data.KINDS))
    ap.add_argument("--work", default=str(RESULTS / "scale"), help="datasets, roots, ledgers")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--stat-latency-ms", type=float, default=0.5)
    ap.add_argument("--opens-only", action="store_true", help="only the opens, --repeat times")
    ap.add_argument(
        "--freshness-only",
        action="store_true",
        help="only the per-epoch file check with the stat latency injected (JSONL)",
    )
    ap.add_argument(
        "--sweep-limit", type=int, default=0, help="samples per freshness epoch (0: all)"
    )
    ap.add_argument("--freshness", default="epoch", help="the JSONL source's freshness=")
    ap.add_argument("--recheck", type=float, default=0.0, help="the JSONL source's recheck=")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tag", default="scale", help="name of the result files")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        args.n = int(args.n)
        run_phase(args)
        return
    ns = [int(float(v)) for v in args.n.split(",") if v] + ([1_000_000] if args.big else [])
    info: dict[str, Any] = {
        "machine": machine(),
        "args": vars(args),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    runs: dict[str, dict[str, Any]] = {}
    for source in args.sources.split(","):
        for n in ns:
            r: dict[str, Any] = {"source": source, "n": n, "stat_latency_ms": args.stat_latency_ms}
            if args.opens_only:
                r["open"] = run_child(args, "opens", source, n)
            elif args.freshness_only:
                r["freshness"] = run_child(args, "freshness", source, n)
            else:
                r["first"] = run_child(args, "first", source, n)
                r["second"] = run_child(args, "second", source, n)
                r["open"] = {
                    "open_first": r["first"]["open_first"],
                    "open_later": r["second"]["open_later"],
                }
            runs[f"{source} {n:,}"] = r
    info["load_average_end"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)  # the figures first: nothing below can lose them
    (RESULTS / f"{args.tag}.json").write_text(
        json.dumps({**info, "runs": runs}, indent=1, default=str)
    )
    m = info["machine"]
    head = (
        f"mmcache at commit {m['commit']} ({m['mmcache']}), {m['cpu']} ({m['cores']} cores), "
        f"load average {m['load_average'][0]:.1f} at start, {info['load_average_end'][0]:.1f}"
        f" at end; stat latency injected: {args.stat_latency_ms} ms; JSONL freshness="
        f"{args.freshness!r}, recheck={args.recheck:g}"
    )
    notes = slopes(runs)
    report = head + "\n\n" + table(runs) + "".join(f"\n- {s}" for s in notes) + "\n"
    print(report)
    (RESULTS / f"{args.tag}.md").write_text(report)


if __name__ == "__main__":
    main()
