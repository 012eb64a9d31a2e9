"""Side-by-side benchmark of mmcache against peer data loaders (issue 6).

Run it with ``benchmarks/peers/run.sh [options]`` (it creates the venv with the
peers); ``--help`` lists the options, ``--quick`` is a smoke run.

What it does:

1. makes the synthetic data once (``mmcache.synth.make_dataset``): a COCO-sized
   set (``--n``, default 3,000) and a large-source set (``--large-n``, default 500,
   1,000-2,000 px sides), and a BPE tokenizer trained on the captions;
2. runs every system (see ``systems.py``) in its own child process, with a
   timeout, on each set: the same pipeline (resize 256, crop 224, 32 tokens), the
   same batch size, workers and number of epochs (first = cold, the rest warm);
3. while a child runs, samples every 0.2 s the PSS of the child and all its
   descendants (DataLoader workers, conversion pools) and the bytes of files that
   appeared in ``/dev/shm`` since it started; split by phase (set-up, epochs);
4. writes a Markdown table and the raw JSON to ``benchmarks/results/``
   (``peers-<date>.md/.json`` and ``peers-latest.md/.json``), with every figure
   also as a ratio to the reference row (``mmcache-memory``), and the checks the
   issue expects.

A system that cannot be installed (see run.sh), imported or run is reported with
the reason, never dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

import shards  # noqa: E402
import systems  # noqa: E402  (needs HERE on sys.path; also what child processes import)


def _merge_systems() -> None:
    """The shard rows (shards.py) into ``systems.SYSTEMS``, each after the row it follows."""
    merged: dict[str, type[systems.System]] = {}
    for name, cls in systems.SYSTEMS.items():
        merged[name] = cls
        for extra in shards.AFTER.get(name, []):
            merged[extra] = shards.SYSTEMS[extra]
    merged.update({k: v for k, v in shards.SYSTEMS.items() if k not in merged})
    systems.SYSTEMS.clear()
    systems.SYSTEMS.update(merged)


_merge_systems()
DEFAULT_SYSTEMS = list(systems.SYSTEMS)
REFERENCE = "mmcache-memory"
# Which requirements.txt entry each system needs (for "not installable" reasons).
NEEDS = {
    "hf-datasets": "datasets",
    "hf-datasets-arrow": "datasets",
    "mosaic-mds-arrays": "mosaicml-streaming",
    "mosaic-mds-jpeg": "mosaicml-streaming",
    "litdata": "litdata",
    "webdataset": "webdataset",
    "webdataset-jpeg": "webdataset",
    "energon": "megatron-energon",
}
# Rows that are not peers: excluded from "mmcache's warm epoch ahead of every peer".
NOT_PEERS = ("mmcache-", "numpy-")
SHM = Path("/dev/shm")
MB = 1e6


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------


def prepare_data(data_dir: Path, variants: dict[str, int], seed: int, vocab: int) -> dict[str, Any]:
    """Make (or reuse) each variant's images + manifest, and the shared tokenizer."""
    from mmcache.synth import make_dataset, synth_captions
    from mmcache.transforms import train_tokenizer

    data_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    largest = max(variants.values())
    tok_path = data_dir / f"tokenizer-n{largest}-s{seed}-v{vocab}.json"
    if not tok_path.exists():
        train_tokenizer(synth_captions(largest, seed), vocab_size=vocab).save(str(tok_path))
    for name, n in variants.items():
        vdir = data_dir / f"{name}-n{n}-s{seed}"
        meta = {"n": n, "seed": seed, "large": name == "large"}
        meta_path = vdir / "meta.json"
        t0 = time.perf_counter()
        if not (meta_path.exists() and json.loads(meta_path.read_text()) == meta):
            print(f"making {n} {name} images in {vdir} ...", flush=True)
            make_dataset(vdir, n, seed, large=name == "large")
            meta_path.write_text(json.dumps(meta))
        manifest = vdir / "manifest.jsonl"
        out[name] = {
            "n": n,
            "manifest": str(manifest),
            "tokenizer": str(tok_path),
            "jpeg_bytes": systems.du(vdir / "images"),
            "make_s": time.perf_counter() - t0,
            "sample_bytes": encoded_sample_bytes(str(manifest), str(tok_path)),
        }
    return out


def encoded_sample_bytes(manifest: str, tokenizer: str) -> int:
    """Bytes of one preprocessed sample as mmcache stores it (the budgets' unit)."""
    from mmcache import codec

    pipe = systems.make_pipeline(tokenizer)
    row = systems.read_rows(manifest)[0]
    sample = pipe.process(row["image_path"], row["caption"], sample_id=row["id"])
    return int(codec.encoded_size(sample))


# ----------------------------------------------------------------------------------------------
# Running one system
# ----------------------------------------------------------------------------------------------


def _shm_names() -> set[str]:
    try:
        return {e.name for e in os.scandir(SHM)}
    except OSError:
        return set()


class Monitor(threading.Thread):
    """Peak PSS of a process tree and peak bytes of new /dev/shm files, per phase."""

    def __init__(self, pid: int, shm_before: set[str], interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        import psutil

        self.psutil = psutil
        self.proc = psutil.Process(pid)
        self.shm_before = shm_before
        self.interval = interval
        self.phase = "start"
        self.peak_pss: dict[str, int] = {}
        self.peak_shm: dict[str, int] = {}
        self.seen_shm: set[str] = set()
        self.stop_event = threading.Event()

    def _held_shm(self, pid: int) -> set[str]:
        """Names of /dev/shm files that process ``pid`` maps or has open."""
        names = set()
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find("/dev/shm/")
                    if at >= 0 and not line.rstrip().endswith("(deleted)"):
                        names.add(line[at + 9 :].rstrip())
        except OSError:
            pass
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target.startswith("/dev/shm/") and not target.endswith("(deleted)"):
                    names.add(target[9:])
        except OSError:
            pass
        return names

    def sample(self) -> None:
        psutil = self.psutil
        total = 0
        try:
            procs = [self.proc, *self.proc.children(recursive=True)]
        except psutil.Error:
            return
        held: set[str] = set()
        for p in procs:
            try:
                total += p.memory_full_info().pss
            except (psutil.Error, OSError):
                continue
            held |= self._held_shm(p.pid)
        # Files in /dev/shm that this tree created (absent before it started) and
        # holds now; other processes of the machine are not counted.
        held -= self.shm_before
        self.seen_shm |= held
        shm = 0
        for name in held:
            try:
                shm += os.stat(SHM / name).st_blocks * 512
            except OSError:
                continue
        ph = self.phase
        self.peak_pss[ph] = max(self.peak_pss.get(ph, 0), total)
        self.peak_shm[ph] = max(self.peak_shm.get(ph, 0), shm)

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.interval)


def install_errors() -> dict[str, str]:
    """Reasons recorded by run.sh for peers that pip could not install."""
    status = Path(sys.prefix) / "install-status"
    out = {}
    if status.is_dir():
        for p in status.glob("*.err"):
            out[p.stem] = " ".join(p.read_text(errors="replace").split())[:500]
    return out


def run_system(
    name: str, variant: str, data: dict[str, Any], args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    out = work / f"{variant}-{name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = {
        "system": name,
        "variant": variant,
        "n": data["n"],
        "manifest": data["manifest"],
        "tokenizer": data["tokenizer"],
        "sample_bytes": data["sample_bytes"],
        "epochs": args.epochs,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "min_warm_s": args.min_warm_s,
        "max_epochs": args.max_epochs,
        "out": str(out / "data"),
    }
    spec_path = out / "spec.json"
    result_path = out / "result.json"
    log_path = work / f"{variant}-{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    # Keep every byte a peer writes under its own folder (so that "disk used" sees it
    # and the clean-up removes it), and keep peers offline and quiet.
    side = out / "side"
    for var, sub in (
        ("HF_HOME", "hf"),
        ("XDG_CACHE_HOME", "xdg"),
        ("LITDATA_CACHE_DIR", "litdata"),
        ("TMPDIR", "tmp"),
    ):
        (side / sub).mkdir(parents=True, exist_ok=True)
        env[var] = str(side / sub)
    env.update(
        {
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "LITDATA_DISABLE_VERSION_CHECK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(
                [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
    )
    shm_before = _shm_names()
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "bench.py"), "--child", str(spec_path), str(result_path)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            cwd=str(ROOT),
            start_new_session=True,  # its own process group: a timeout kills the whole tree
        )
        monitor = Monitor(proc.pid, shm_before)
        monitor.start()

        def read_stdout() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("@@phase "):
                    monitor.sample()  # close the previous phase with a fresh sample
                    monitor.phase = line.split()[1]
                else:
                    log.write(line)

        reader = threading.Thread(target=read_stdout, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group of the child we started
            proc.wait()
        wall = time.perf_counter() - t0
        monitor.stop_event.set()
        monitor.join()
        reader.join(timeout=5)
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        result = {
            "system": name,
            "status": "timeout" if timed_out else "crashed",
            "reason": (
                f"no result after {args.timeout:.0f} s (killed)"
                if timed_out
                else f"exit code {proc.returncode}: " + " | ".join(tail)[:400]
            ),
            "notes": [],
        }
    result["variant"] = variant
    result["wall_s"] = wall
    result["peak_pss_bytes"] = monitor.peak_pss
    result["peak_shm_bytes"] = monitor.peak_shm
    result["log"] = str(log_path)
    left = sorted(n for n in monitor.seen_shm if (SHM / n).exists())
    if left:
        result.setdefault("notes", []).append(
            f"left {len(left)} file(s) in /dev/shm after exit: {', '.join(left[:5])}"
        )
    shutil.rmtree(out, ignore_errors=True)
    summarise(result)
    return result


def summarise(r: dict[str, Any]) -> None:
    """Derived figures: cold and warm samples/s, peaks in the epochs and set-up phases."""
    epochs = r.get("epochs") or []
    if r.get("status") == "ok" and epochs:
        rate = [e["samples"] / e["s"] if e["s"] > 0 else 0.0 for e in epochs]
        cpu = [1000 * e.get("cpu_s", 0.0) / max(e["samples"], 1) for e in epochs]
        r["cold_sps"], r["cold_cpu_ms"] = rate[0], cpu[0]
        warm, warm_cpu = epochs[1:], cpu[1:]
        # Warm rate: samples over time of all warm epochs (a mean weighted by time).
        r["warm_sps"] = (
            sum(e["samples"] for e in warm) / sum(e["s"] for e in warm) if warm else None
        )
        r["warm_cpu_ms"] = sum(warm_cpu) / len(warm_cpu) if warm_cpu else None
        if r["system"].startswith("numpy-gather"):
            # Set-up preprocessed everything: every epoch is warm.
            r["warm_sps"] = sum(e["samples"] for e in epochs) / sum(e["s"] for e in epochs)
            r["warm_cpu_ms"] = sum(cpu) / len(cpu)
            r["cold_sps"] = r["cold_cpu_ms"] = None
    pss = r.get("peak_pss_bytes") or {}
    shm = r.get("peak_shm_bytes") or {}
    r["peak_setup_mb"] = pss.get("setup", 0) / MB if pss else None
    r["peak_epochs_mb"] = max(pss.get("epochs", 0), pss.get("check", 0)) / MB if pss else None
    r["peak_mb"] = max(pss.values()) / MB if pss else None
    r["shm_mb"] = max(shm.values()) / MB if shm else None


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def _f(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "—"
    return f"{x:,.{digits}f}"


def _ratio(x: float | None, ref: float | None) -> str:
    if x is None or ref is None or ref == 0:
        return "—"
    return f"{x / ref:.2f}x"


def _stored_mb(r: dict[str, Any]) -> float:
    """What a system keeps: bytes on disk plus the /dev/shm files it holds."""
    return (r.get("disk_bytes") or 0) / MB + (r.get("shm_mb") or 0.0)


def table(results: list[dict[str, Any]], variant: str, reference: str) -> list[str]:
    rows = [r for r in results if r["variant"] == variant]
    ref = next((r for r in rows if r["system"] == reference and r["status"] == "ok"), None)
    lines = [
        "| system | version | set-up s | cold samples/s | warm samples/s "
        "| CPU ms/sample cold / warm | peak PSS MB set-up / epochs | /dev/shm MB held "
        "| disk MB | notes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(
                f"| {r['system']} | {r.get('version') or '—'} | — | — | — | — | — | — | — "
                f"| **{r['status']}**: {r.get('reason', '')} |"
            )
            continue
        notes = list(r.get("notes") or [])
        if r.get("content_ok") is False:
            notes.insert(0, "**content differs**")
        lines.append(
            f"| {r['system']} | {r.get('version') or '—'} | {_f(r.get('setup_s'), 1)} "
            f"| {_f(r.get('cold_sps'))} | {_f(r.get('warm_sps'))} "
            f"| {_f(r.get('cold_cpu_ms'), 2)} / {_f(r.get('warm_cpu_ms'), 2)} "
            f"| {_f(r.get('peak_setup_mb'))} / {_f(r.get('peak_epochs_mb'))} "
            f"| {_f(r.get('shm_mb'))} | {_f((r.get('disk_bytes') or 0) / MB)} "
            f"| {'; '.join(notes)} |"
        )
    if ref is None:
        return [*lines, "", f"(no ratios: `{reference}` did not run successfully)"]
    lines += [
        "",
        f"The same figures as ratios to `{reference}` (samples/s: above 1 is faster than "
        "mmcache; CPU, memory and storage: above 1 is more than mmcache; set-up: seconds "
        "more than mmcache's). Stored = disk + /dev/shm held.",
        "",
        "| system | cold samples/s | warm samples/s | CPU/sample cold | CPU/sample warm "
        "| set-up s more | peak PSS epochs | stored |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] != "ok":
            continue
        setup_more = None
        if r.get("setup_s") is not None and ref.get("setup_s") is not None:
            setup_more = r["setup_s"] - ref["setup_s"]
        lines.append(
            f"| {r['system']} | {_ratio(r.get('cold_sps'), ref.get('cold_sps'))} "
            f"| {_ratio(r.get('warm_sps'), ref.get('warm_sps'))} "
            f"| {_ratio(r.get('cold_cpu_ms'), ref.get('cold_cpu_ms'))} "
            f"| {_ratio(r.get('warm_cpu_ms'), ref.get('warm_cpu_ms'))} "
            f"| {_f(setup_more, 1)} "
            f"| {_ratio(r.get('peak_epochs_mb'), ref.get('peak_epochs_mb'))} "
            f"| {_ratio(_stored_mb(r), _stored_mb(ref))} |"
        )
    return lines


def checks(results: list[dict[str, Any]], variant: str, reference: str) -> list[str]:
    rows = {r["system"]: r for r in results if r["variant"] == variant}
    ref = rows.get(reference)
    if ref is None or ref["status"] != "ok":
        return [f"- {variant}: cannot check: `{reference}` did not run"]
    out = []
    peers = [
        r
        for r in rows.values()
        if r["status"] == "ok" and not r["system"].startswith(NOT_PEERS) and r.get("warm_sps")
    ]
    if peers:
        best = max(peers, key=lambda r: r["warm_sps"])
        ok = ref["warm_sps"] > best["warm_sps"]
        out.append(
            f"- {variant}: warm epoch ahead of every peer's: **{'yes' if ok else 'NO'}** "
            f"({ref['warm_sps']:,.0f} vs best peer {best['system']} {best['warm_sps']:,.0f} "
            f"samples/s, {ref['warm_sps'] / best['warm_sps']:.2f}x)"
        )
    base = rows.get("torch-uncached")
    if base and base["status"] == "ok" and base.get("cold_sps"):
        ratio = ref["cold_sps"] / base["cold_sps"]
        cpu = ""
        if ref.get("cold_cpu_ms") and base.get("cold_cpu_ms"):
            cpu = (
                f"; CPU per sample {ref['cold_cpu_ms']:.2f} vs {base['cold_cpu_ms']:.2f} ms, "
                f"{ref['cold_cpu_ms'] / base['cold_cpu_ms']:.2f}x"
            )
        out.append(
            f"- {variant}: cold epoch within 5% of the uncached torch DataLoader: "
            f"**{'yes' if ratio >= 0.95 else 'NO'}** ({ref['cold_sps']:,.0f} vs "
            f"{base['cold_sps']:,.0f} samples/s, {ratio:.2f}x{cpu})"
        )
    setup = ref.get("setup_s") or 0.0
    out.append(
        f"- {variant}: set-up cost zero (the first epoch is the warm-up): "
        f"**{'yes' if setup < 1.0 else 'NO'}** ({setup:.2f} s to construct the objects)"
    )
    return out


def report(
    results: list[dict[str, Any]],
    data: dict[str, Any],
    args: argparse.Namespace,
    env: dict[str, Any],
) -> str:
    lines = [
        f"# Peer benchmark, {env['date']}",
        "",
        f"Machine: {env['cpus']} CPUs, {env['memory_gb']:.0f} GB RAM, no GPU; "
        f"Python {env['python']}, torch {env['torch']}. Command: `{env['command']}`.",
        f"Batch {args.batch_size}, {args.workers} workers, {args.epochs} epochs "
        "(the first is cold, the others warm; warm epochs shorter than "
        f"{args.min_warm_s:g} s in all are repeated, up to {args.max_epochs} epochs), shuffled, "
        "one run. CPU ms/sample: CPU time of the process and its workers per sample "
        "(less sensitive than samples/s to other load on the machine). "
        "Every system delivers uint8 images [B,3,224,224] + int32 ids/mask [B,32] from the "
        "same mmcache Pipeline (resize 256, centre crop 224, 32 tokens). "
        "Peak PSS sums the process and all its children; /dev/shm files mapped by a "
        "process are also in its PSS.",
        "",
    ]
    for variant, info in data.items():
        lines += [
            f"## {variant}: {info['n']} samples, JPEGs {info['jpeg_bytes'] / MB:,.0f} MB, "
            f"preprocessed {info['sample_bytes'] * info['n'] / MB:,.0f} MB",
            "",
        ]
        lines += table(results, variant, args.reference)
        lines += ["", *checks(results, variant, args.reference), ""]
    return "\n".join(lines) + "\n"


def environment() -> dict[str, Any]:
    import psutil
    import torch

    return {
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "memory_gb": psutil.virtual_memory().total / 2**30,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "command": " ".join(["benchmarks/peers/run.sh", *sys.argv[1:]]),
    }


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=3000, help="COCO-sized samples (default 3000)")
    p.add_argument("--large-n", type=int, default=500, help="large-source samples (default 500)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per system (default 3)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2)")
    p.add_argument(
        "--min-warm-s",
        type=float,
        default=2.0,
        help="run extra warm epochs while the warm ones add up to less (default 2.0 s)",
    )
    p.add_argument("--max-epochs", type=int, default=20, help="cap for those extra epochs")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="coco,large", help="data sets to run: coco,large")
    p.add_argument("--only", default="", help="comma-separated systems to run")
    p.add_argument("--skip", default="", help="comma-separated systems to leave out")
    p.add_argument("--quick", action="store_true", help="smoke run: n=300, large-n=50, 2 epochs")
    p.add_argument("--timeout", type=float, default=900, help="seconds per system (default 900)")
    p.add_argument("--reference", default=REFERENCE, help="row the ratios refer to")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--data-dir", default=None, help="keep/reuse the synthetic data here")
    p.add_argument(
        "--work-dir", default=None, help="where systems write (each one's folder removed after it)"
    )
    p.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--list", action="store_true", help="list the systems and exit")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.large_n, args.epochs = 300, 50, 2
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, cls in systems.SYSTEMS.items():
            doc = (cls.__doc__ or "").strip().splitlines()
            print(f"{name:22s} {doc[0] if doc else ''}")
        return 0
    only = [s for s in args.only.split(",") if s]
    skip = {s for s in args.skip.split(",") if s}
    unknown = [s for s in [*only, *skip] if s not in systems.SYSTEMS]
    if unknown:
        print(f"unknown systems: {', '.join(unknown)} (see --list)", file=sys.stderr)
        return 2
    names = [s for s in (only or DEFAULT_SYSTEMS) if s not in skip]
    sizes = {"coco": args.n, "large": args.large_n}
    variants = {v: sizes[v] for v in args.variants.split(",") if v}
    tmp_root = Path(tempfile.mkdtemp(prefix="mmcache-peers-"))
    data_dir = Path(args.data_dir) if args.data_dir else tmp_root / "data"
    work = Path(args.work_dir) if args.work_dir else tmp_root / "work"
    work.mkdir(parents=True, exist_ok=True)
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    logs_dir = results_dir / f"peers-{stamp}-logs"
    missing = install_errors()
    results: list[dict[str, Any]] = []
    try:
        data = prepare_data(data_dir, variants, args.seed, args.vocab_size)
        for variant, info in data.items():
            for name in names:
                need = NEEDS.get(name)
                if need and need in missing:
                    results.append(
                        {
                            "system": name,
                            "variant": variant,
                            "status": "not installable",
                            "reason": missing[need],
                        }
                    )
                    print(f"[{variant}] {name}: not installable: {missing[need]}", flush=True)
                    continue
                print(f"[{variant}] {name} ...", end=" ", flush=True)
                r = run_system(name, variant, info, args, work)
                results.append(r)
                if r["status"] == "ok":
                    print(
                        f"set-up {_f(r.get('setup_s'), 1)} s, cold {_f(r.get('cold_sps'))}/s, "
                        f"warm {_f(r.get('warm_sps'))}/s, peak {_f(r.get('peak_mb'))} MB",
                        flush=True,
                    )
                else:
                    print(f"{r['status']}: {r.get('reason')}", flush=True)
                logs_dir.mkdir(exist_ok=True)
                shutil.copy(r["log"], logs_dir / Path(r["log"]).name)
                r["log"] = str((logs_dir / Path(r["log"]).name).relative_to(results_dir))
        text = report(results, data, args, env)
        payload = {"environment": env, "args": vars(args), "data": data, "results": results}
        for base in (f"peers-{stamp}", "peers-latest"):
            (results_dir / f"{base}.md").write_text(text)
            (results_dir / f"{base}.json").write_text(json.dumps(payload, indent=1, default=str))
        print()
        print(text)
        print(f"written: {results_dir / f'peers-{stamp}.md'} (and .json, logs in {logs_dir})")
    finally:
        # Our temporary folder (data unless --data-dir, work unless --work-dir) goes;
        # folders the user named stay (each system's own subfolder is already gone).
        shutil.rmtree(tmp_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        systems.child_main(sys.argv[2], sys.argv[3])
    sys.exit(main())
