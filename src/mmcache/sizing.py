"""Byte budgets sized from what the machine really has free.

``memory="auto"`` takes :data:`~mmcache.units.DEFAULT_MEMORY_FRACTION` (half) of
the memory this process can really use:

``available = min(MemAvailable, cgroup limit - cgroup usage, room in /dev/shm)``

``room in /dev/shm = free space - promised - headroom``

- ``MemAvailable`` (``/proc/meminfo``) is the kernel's estimate of memory that
  can be taken without swapping; ``MemFree`` would ignore reclaimable page cache.
- A container's cgroup limit (v2 ``memory.max``/``memory.current`` or v1
  ``memory.limit_in_bytes``/``memory.usage_in_bytes``) is often far below the
  host's memory; ignoring it gets the training job OOM-killed.
- The memory tier lives in ``/dev/shm`` (tmpfs), whose size is capped
  separately (Docker's default is 64 MiB).
- A memory store reserves its pages as it fills, so the free space of
  ``/dev/shm`` does not show the budgets other jobs' stores were given: three
  jobs sized at once from the free space alone would each take half of it and
  together overfill it. ``promised`` is what the live stores of the node may
  still take (their budgets less what they hold; the caller reads them:
  :func:`mmcache.stores.memory.budgets.shm_claims`, one job at a time under
  :func:`~mmcache.stores.memory.budgets.sizing_turn`), and the pages a reopened
  store holds already count as room for it.
- ``headroom`` (:data:`DEFAULT_SHM_HEADROOM` of the size of ``/dev/shm``) is left
  to the loader's own shared memory (batch buffers crop processes read, their
  queues) and torch's; a loader that finds no room there goes on without them
  (:mod:`mmcache.loader.shmroom`), but the tier is sized not to force it.

Half, not all: the training process, its workers, pinned batches and the page
cache of the disk tier need the rest. :func:`host_memory` returns every figure
used so users (and ``mmcache stats``) can see why a budget came out as it did.

GPU budgets (the feature cache) come from ``torch.cuda.mem_get_info`` minus a
headroom, see :func:`gpu_memory`.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mmcache.units import DEFAULT_MEMORY_FRACTION, GiB

__all__ = [
    "DEFAULT_GPU_HEADROOM",
    "GpuMemory",
    "HostMemory",
    "auto_gpu_budget",
    "auto_memory_budget",
    "describe",
    "gpu_memory",
    "host_memory",
]

#: Fraction of the size of ``/dev/shm`` that ``memory="auto"`` leaves to the loader's own
#: shared memory and torch's (8 MiB of a container's 64 MiB).
DEFAULT_SHM_HEADROOM = 0.125

#: Fraction of the GPU's free memory left untouched by ``memory="auto"`` on a GPU
#: tier: activations and the allocator's fragmentation need room to grow.
DEFAULT_GPU_HEADROOM = 0.5

# cgroup v1 reports "no limit" as a huge page-aligned number (2**63 rounded down).
_NO_LIMIT = 1 << 60


@dataclass(frozen=True)
class HostMemory:
    """The figures ``memory="auto"`` used, in bytes (``None``: not found on this host).

    ``shm_promised``: what other live memory stores may still take of ``/dev/shm``;
    ``shm_headroom``: what is left to the loader's own shared memory.
    """

    mem_available: int | None
    cgroup_limit: int | None
    cgroup_usage: int | None
    shm_free: int | None
    available: int
    shm_size: int | None = None
    shm_promised: int = 0
    shm_headroom: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GpuMemory:
    """Free and total memory of one CUDA device, in bytes."""

    device: str
    free: int
    total: int


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _mem_available(proc: Path) -> int | None:
    try:
        with open(proc / "meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_dirs(proc: Path, cgroup_root: Path) -> list[tuple[Path, str]]:
    """Candidate (directory, version) pairs, most specific first.

    Inside a container the path in /proc/self/cgroup often does not exist under
    the container's /sys/fs/cgroup (it is the host's path); the mount root is
    then the container's own cgroup, so fall back to it.
    """
    out: list[tuple[Path, str]] = []
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":
            out.append((cgroup_root / rel, "v2"))
        elif "memory" in controllers.split(","):
            out.append((cgroup_root / "memory" / rel, "v1"))
    out.append((cgroup_root, "v2"))
    out.append((cgroup_root / "memory", "v1"))
    return out


def _cgroup_memory(proc: Path, cgroup_root: Path) -> tuple[int | None, int | None]:
    for directory, version in _cgroup_dirs(proc, cgroup_root):
        if version == "v2":
            limit_file, usage_file = directory / "memory.max", directory / "memory.current"
        else:
            limit_file = directory / "memory.limit_in_bytes"
            usage_file = directory / "memory.usage_in_bytes"
        if not limit_file.exists():
            continue
        limit = _read_int(limit_file)
        usage = _read_int(usage_file)
        if limit is not None and limit >= _NO_LIMIT:
            limit = None
        return limit, usage
    return None, None


def _shm_space(shm: Path) -> tuple[int | None, int | None]:
    """(free, size) of the file system at ``shm``, or (None, None)."""
    try:
        st = os.statvfs(shm)
    except OSError:
        return None, None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def host_memory(
    *,
    proc: str | os.PathLike[str] = "/proc",
    cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
    shm: str | os.PathLike[str] = "/dev/shm",
    shm_promised: int = 0,
    shm_own: int = 0,
    shm_headroom: float = DEFAULT_SHM_HEADROOM,
) -> HostMemory:
    """Read what the host really has free (thread- and process-safe: reads files only).

    ``shm_promised``: bytes of ``shm`` other live memory stores may still take;
    ``shm_own``: bytes the store being sized holds there already (both from
    :func:`mmcache.stores.memory.budgets.shm_claims`); ``shm_headroom``: the
    fraction of its size left to the loader (see the module docstring).
    The paths are parameters so that tests can point them at fake trees.
    """
    proc_p, cg_p = Path(proc), Path(cgroup_root)
    mem_available = _mem_available(proc_p)
    limit, usage = _cgroup_memory(proc_p, cg_p)
    shm_free, shm_size = _shm_space(Path(shm))
    headroom = int((shm_size or 0) * shm_headroom)
    candidates = [v for v in (mem_available,) if v is not None]
    if shm_free is not None:
        candidates.append(max(shm_free + shm_own - shm_promised - headroom, 0))
    if limit is not None:
        candidates.append(max(limit - (usage or 0), 0))
    if not candidates:
        # Nothing readable (not Linux?): ask psutil, which knows other platforms.
        import psutil

        candidates.append(int(psutil.virtual_memory().available))
    return HostMemory(
        mem_available=mem_available,
        cgroup_limit=limit,
        cgroup_usage=usage,
        shm_free=shm_free,
        available=min(candidates),
        shm_size=shm_size,
        shm_promised=shm_promised,
        shm_headroom=headroom,
    )


def auto_memory_budget(
    fraction: float = DEFAULT_MEMORY_FRACTION, *, host: HostMemory | None = None
) -> int:
    """Bytes for ``memory="auto"``: ``fraction`` of :func:`host_memory`'s ``available``."""
    if not 0.0 < fraction <= 1.0:
        from mmcache.errors import ConfigError

        raise ConfigError(f"memory fraction must be in (0, 1], got {fraction}")
    figures = host if host is not None else host_memory()
    return int(figures.available * fraction)


def gpu_memory(device: Any = None) -> GpuMemory | None:
    """Free/total memory of a CUDA device from ``torch.cuda.mem_get_info``; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(dev)
    return GpuMemory(device=str(dev), free=int(free), total=int(total))


def auto_gpu_budget(device: Any = None, *, headroom: float = DEFAULT_GPU_HEADROOM) -> int | None:
    """Bytes for a GPU tier: free GPU memory times ``1 - headroom``; None without CUDA."""
    figures = gpu_memory(device)
    if figures is None:
        return None
    return int(figures.free * (1.0 - headroom))


def describe(host: HostMemory) -> str:
    """One line for logs: which figure bounded the budget."""
    parts = []
    for name, value in host.as_dict().items():
        if value is not None and name != "available":
            parts.append(f"{name}={value / GiB:.2f}GiB")
    return f"available={host.available / GiB:.2f}GiB ({', '.join(parts)})"
