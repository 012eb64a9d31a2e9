"""Shared fixtures: a small synthetic dataset and a tokenizer, made once per test session."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Tokenizers starts a thread pool on first batch use; forked DataLoader workers
# then warn. The library only encodes single strings, but be explicit in tests.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Manifests' column files (mmcache.sources.nodecolumns) of this test session go to a folder
# of its own, removed at its end (pytest_sessionfinish), not to the user's ~/.cache (child
# processes inherit it).
_COLUMNS = None
if "MMCACHE_COLUMNS_DIR" not in os.environ:
    _COLUMNS = tempfile.mkdtemp(prefix="mmcache-test-columns-")
    os.environ["MMCACHE_COLUMNS_DIR"] = _COLUMNS


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 48-sample COCO-like synthetic dataset; returns the manifest path."""
    from mmcache.synth import make_dataset

    out = tmp_path_factory.mktemp("tiny-data")
    return make_dataset(out, 48, seed=1)


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmcache.synth import synth_captions
    from mmcache.transforms import train_tokenizer

    tok = train_tokenizer(synth_captions(500, seed=0), vocab_size=512)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture
def small_pipeline(tokenizer_json: Path):  # type: ignore[no-untyped-def]
    """Pipeline with 64 px images and 16 tokens: fast, same code paths as 224 px."""
    from mmcache.transforms import ImageSpec, TextSpec
    from mmcache.transforms.pipeline import Pipeline

    return Pipeline(image=ImageSpec(size=64), text=TextSpec(tokenizer_json, max_length=16))


@pytest.fixture
def cache_root(tmp_path: Path) -> Iterator[Path]:
    """A cache root whose shared-memory segments are removed after the test."""
    root = tmp_path / "cache"
    yield root
    from mmcache.cache import _memory_name
    from mmcache.stores.memory import store_dir

    name = _memory_name(root.absolute())
    for directory in {store_dir(), store_dir(os.getegid())}:  # mode=0o660: the group's
        for path in glob.glob(f"{directory}/mmcache-{name}*"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _mount_tmpfs(path: Path, size: str) -> Path:
    """Mount a tmpfs of ``size`` at ``path`` or skip the test with the reason."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount/umount command")
    path.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    return path


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str, str], Path]]:
    """``tmpfs(name, size)`` mounts a small file system (a full disk or /dev/shm in
    miniature) under ``tmp_path``; all are unmounted afterwards. Skips without root."""
    mounted: list[Path] = []

    def make(name: str, size: str) -> Path:
        mounted.append(_mount_tmpfs(tmp_path / name, size))
        return mounted[-1]

    yield make
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


# --- shared-memory leak guard ------------------------------------------------
# A test that opens a memory tier and does not remove it leaves files in this
# user's /dev/shm directory after the run. Each test's new entries are noted;
# when the session ends (after every fixture's teardown), a store still there
# is a leak only if its cache root lies under this session's temporary
# directory: its name is that of a folder there, or the owner path written in
# its header is there (a root the test deleted). Leaks are reported with the
# test that made them and removed. Everything else is left alone, even a store
# nobody is attached to whose root is gone: another pytest run or training job
# of the same user makes and leaves such stores at any moment (between two of
# its tests, or because a run's start removed older runs' temporary folders),
# and judging them by liveness here blamed and removed the files of other runs
# (``mmcache gc`` reclaims real orphans). MMCACHE_TEST_SHM_STRICT=1 (set by
# `make test`) turns a leak into a failed run.

_SHM_MADE: dict[str, str] = {}


def _shm_entries() -> set[str]:
    from mmcache.stores.memory import store_dir

    found: set[str] = set()
    for directory in {store_dir(), store_dir(os.getegid())}:
        found.update(glob.glob(f"{directory}/mmcache-*"))
    return found


@pytest.fixture(autouse=True)
def _note_shm_entries(request: pytest.FixtureRequest) -> Iterator[None]:
    before = _shm_entries()
    yield
    for path in _shm_entries() - before:
        _SHM_MADE.setdefault(path, request.node.nodeid)


def _under(path: str, base: Path) -> bool:
    return Path(path).absolute().is_relative_to(base.absolute())


def _leaked_stores(base: Path) -> dict[str, str]:
    """{path: test} of the stores this session left behind (see above); removes them."""
    from mmcache.cacheroot import memory_name
    from mmcache.stores.memory.cleanup import _store_names, store_owner, unlink_store

    present = {p: t for p, t in _SHM_MADE.items() if os.path.exists(p)}
    if not present:
        return {}
    ours = {memory_name(Path(d).absolute()) for d, _dirs, _files in os.walk(base)}
    ours |= {f"{name}-flight" for name in ours}  # scope="cluster"'s in-flight tier
    leaked: dict[str, str] = {}
    for directory in sorted({os.path.dirname(p) for p in present}):
        group = os.getegid() if os.path.basename(directory).startswith("mmcache-g") else None
        for name, files in sorted(_store_names(directory, "*").items()):
            paths = {p: present[p] for p in files if p in present}
            if not paths:
                continue
            owner = store_owner(name, group=group)
            if name in ours or (owner is not None and _under(owner, base)):
                unlink_store(name, group=group)
                leaked.update(paths)
    return leaked


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _COLUMNS is not None:
        shutil.rmtree(_COLUMNS, ignore_errors=True)
    base = session.config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    leaked = _leaked_stores(base)
    session.config._mmcache_shm_leaks = leaked  # type: ignore[attr-defined]
    if leaked and os.environ.get("MMCACHE_TEST_SHM_STRICT") == "1" and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    leaked: dict[str, str] = getattr(terminalreporter.config, "_mmcache_shm_leaks", {})
    if not leaked:
        return
    terminalreporter.section("shared-memory files left behind by tests (removed now)")
    for path, test in sorted(leaked.items(), key=lambda kv: kv[1]):
        terminalreporter.write_line(f"{test}: {path}")
