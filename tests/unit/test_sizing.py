from pathlib import Path

import pytest

from mmcache import sizing
from mmcache.errors import ConfigError
from mmcache.units import GiB, MiB


def _fake_tree(
    tmp_path: Path,
    *,
    meminfo_kib: int,
    v2: tuple[str, int] | None = None,
    v1: tuple[int, int] | None = None,
) -> tuple[Path, Path]:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kib} kB\n")
    cg = tmp_path / "cgroup"
    if v2 is not None:
        (proc / "self" / "cgroup").write_text("0::/job\n")
        (cg / "job").mkdir(parents=True)
        (cg / "job" / "memory.max").write_text(v2[0] + "\n")
        (cg / "job" / "memory.current").write_text(f"{v2[1]}\n")
    elif v1 is not None:
        (proc / "self" / "cgroup").write_text("4:memory:/docker/abc\n")
        (cg / "memory" / "docker" / "abc").mkdir(parents=True)
        (cg / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text(f"{v1[0]}\n")
        (cg / "memory" / "docker" / "abc" / "memory.usage_in_bytes").write_text(f"{v1[1]}\n")
    else:
        (proc / "self" / "cgroup").write_text("0::/\n")
        cg.mkdir()
    return proc, cg


def test_cgroup_v2_limit_bounds_available(tmp_path: Path) -> None:
    proc, cg = _fake_tree(tmp_path, meminfo_kib=16 * 1024 * 1024, v2=(str(4 * GiB), 1 * GiB))
    host = sizing.host_memory(proc=proc, cgroup_root=cg, shm=tmp_path)
    assert host.mem_available == 16 * GiB
    assert host.cgroup_limit == 4 * GiB
    assert host.available == 3 * GiB
    assert sizing.auto_memory_budget(0.5, host=host) == int(1.5 * GiB)


def test_cgroup_v2_max_means_no_limit(tmp_path: Path) -> None:
    proc, cg = _fake_tree(tmp_path, meminfo_kib=2 * 1024 * 1024, v2=("max", 5))
    host = sizing.host_memory(proc=proc, cgroup_root=cg, shm="/nonexistent-shm")
    assert host.cgroup_limit is None
    assert host.available == 2 * GiB


def test_cgroup_v1_limit(tmp_path: Path) -> None:
    proc, cg = _fake_tree(tmp_path, meminfo_kib=16 * 1024 * 1024, v1=(512 * MiB, 112 * MiB))
    host = sizing.host_memory(proc=proc, cgroup_root=cg, shm="/nonexistent-shm")
    assert host.available == 400 * MiB


def test_cgroup_v1_unlimited_sentinel_is_ignored(tmp_path: Path) -> None:
    proc, cg = _fake_tree(tmp_path, meminfo_kib=1024 * 1024, v1=(9223372036854771712, 10))
    host = sizing.host_memory(proc=proc, cgroup_root=cg, shm="/nonexistent-shm")
    assert host.cgroup_limit is None
    assert host.available == GiB


def test_shm_free_space_bounds_available(tmp_path: Path) -> None:
    proc, cg = _fake_tree(tmp_path, meminfo_kib=1 << 40)
    host = sizing.host_memory(proc=proc, cgroup_root=cg, shm=tmp_path)
    assert host.shm_free is not None and host.shm_size is not None
    # memory="auto" leaves a share of /dev/shm to the loader's own buffers (issue 37, H4)
    assert host.shm_headroom == int(host.shm_size * sizing.DEFAULT_SHM_HEADROOM)
    assert host.available == min(host.shm_free - host.shm_headroom, 1 << 50)


def test_real_host_figures_are_sane() -> None:
    host = sizing.host_memory()
    assert host.available > 0
    budget = sizing.auto_memory_budget()
    assert 0 < budget <= host.available
    assert "available=" in sizing.describe(host)


def test_fraction_validated() -> None:
    with pytest.raises(ConfigError):
        sizing.auto_memory_budget(1.5)


def test_gpu_memory_without_cuda_is_none() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert sizing.gpu_memory() is None
    assert sizing.auto_gpu_budget() is None
