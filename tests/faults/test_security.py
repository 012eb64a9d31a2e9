"""Security: a cache file is untrusted input, ids are not paths, files are private.

* Planted payloads: a pickle that would create a marker file if anything unpickled
  it, and headers forged with a *valid* checksum but an impossible structure, are put
  into the disk tier through a raw LMDB handle and into the memory tier through
  ``MemoryStore.put``. ``Cache.get`` returns None for each, counts it as corrupt and
  drops it; ``Cache.verify`` lists exactly them; a DataLoader run over planted keys
  yields the uncached batches; nothing is ever executed.
* Hostile ids (``../../etc/passwd``, absolute paths, NUL bytes, ``~``, shell syntax,
  10,000 characters) run through the loader and ``warm``: nothing is created outside
  the cache root, and inside it only the files the cache always has.
* Modes: the root is 0700, LMDB files and ``/dev/shm`` segments 0600, even under a
  umask of 0.
"""

from __future__ import annotations

import builtins
import glob
import json
import marshal
import os
import pickle
import re
import shutil
import stat
import struct
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
import torch
import xxhash

from mmcache import codec
from mmcache.cache import Cache, _memory_name
from mmcache.dataset import MultimodalDataset
from mmcache.errors import CacheError
from mmcache.loader import DataLoader
from mmcache.sources.readers import read_manifest
from mmcache.stores.memory import store_dir
from mmcache.transforms import ImageSpec, TextSpec
from mmcache.transforms.pipeline import Pipeline
from mmcache.warm import warm

SRC = Path(__file__).resolve().parents[2] / "src" / "mmcache"


class Payload:
    """Unpickling this calls ``open(marker, "w")``: the marker file proves execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def checksum(buf: bytes | bytearray) -> int:
    h = xxhash.xxh3_64(bytes(buf[:8]))
    h.update(bytes(buf[16:]))
    return h.intdigest()


def forge(raw: bytes, mutate: Callable[[bytearray], None]) -> bytes:
    """``raw`` changed by ``mutate``, with a checksum recomputed to match (a forger's)."""
    buf = bytearray(raw)
    mutate(buf)
    struct.pack_into("<Q", buf, 8, checksum(buf))
    out = bytes(buf)
    assert len(out) == len(raw)
    return out


def table_at(buf: bytearray, field: int = 0) -> int:
    """Offset of field ``field``'s entry in the field table (fields of ndim 1..3)."""
    pos = codec.HEADER_SIZE
    for _ in range(field):
        name_len, _code, ndim = struct.unpack_from("<HBB", buf, pos)
        pos += 4 + 8 * ndim + 16 + name_len
    return pos


def set_(fmt: str, offset: int, value: Any) -> Callable[[bytearray], None]:
    return lambda b: struct.pack_into(fmt, b, offset, value)


def set_in_table(fmt: str, rel: int, value: Any) -> Callable[[bytearray], None]:
    return lambda b: struct.pack_into(fmt, b, table_at(b) + rel, value)


# Each forgery keeps the entry's length (so the store's own size record still matches:
# the codec must be what refuses it). Offsets: see the format table in mmcache.codec.
FORGERIES: dict[str, Callable[[bytearray], None]] = {
    "version 2": set_("<H", 4, 2),
    "unknown flags": set_("<H", 6, 1),
    "length says shorter": set_("<Q", 16, 100),
    "ctime NaN": set_("<d", 24, float("nan")),
    "cost negative": set_("<d", 32, -1.0),
    "nfields 100000": set_("<I", 40, 100_000),
    "table past the end": set_("<I", 44, 1 << 30),
    "dtype code 99 (object?)": set_in_table("<B", 2, 99),
    "ndim 200": set_in_table("<B", 3, 200),
    "shape of 2**62 elements": set_in_table("<Q", 4, 1 << 62),
    "offset into the header": set_in_table("<Q", 4 + 8 * 3, 0),
}


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a planted pickle was executed"


@pytest.fixture
def no_code_loading(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Make pickle/marshal loads and eval/exec raise (call it around the read path)."""

    def forbid() -> None:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("code loading on the read path")

        for mod, name in (
            (pickle, "loads"),
            (pickle, "load"),
            (pickle, "Unpickler"),
            (marshal, "loads"),
            (marshal, "load"),
            (builtins, "eval"),
            (builtins, "exec"),
        ):
            monkeypatch.setattr(mod, name, refuse)

    return forbid


def sample(i: int) -> dict[str, np.ndarray]:
    return {
        "image": np.full((3, 8, 8), i, dtype=np.uint8),
        "input_ids": np.arange(16, dtype=np.int32) + i,
    }


def key(i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"key-{i}".encode())


def pickle_payload(marker: Path, size: int) -> bytes:
    data = pickle.dumps(Payload(marker), protocol=2)
    # pickle ignores what follows its STOP opcode: pad to the real entry's length
    return data + b"\0" * (size - len(data))


def test_the_library_source_never_loads_code() -> None:
    """No pickle/marshal/eval/exec/torch.load anywhere in the library (read path or not)."""
    forbidden = re.compile(
        r"^\s*(import (pickle|marshal|shelve|dill|cloudpickle)\b|from (pickle|marshal) import)"
        r"|\b(pickle|marshal|dill|cloudpickle)\.(loads?|Unpickler)\b"
        r"|(?<![\w.])(eval|exec)\(|\btorch\.load\(|allow_pickle\s*=\s*True|yaml\.load\(",
        re.MULTILINE,
    )
    hits = [
        f"{path.relative_to(SRC)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0).strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for text in [path.read_text(encoding="utf-8")]
        for m in forbidden.finditer(text)
    ]
    assert hits == []


def test_planted_entries_in_the_disk_tier_are_rejected_not_executed(
    cache_root: Path, marker: Path, no_code_loading: Callable[[], None]
) -> None:
    n_good = 4
    with Cache(cache_root, memory=0, disk="4MiB") as cache:
        for i in range(n_good + 1 + len(FORGERIES)):
            cache.put(key(i), sample(i))
        raw = cache.disk.get(key(0))  # type: ignore[union-attr]
    assert raw is not None
    planted = {key(n_good): pickle_payload(marker, len(raw))}
    for j, mutate in enumerate(FORGERIES.values(), n_good + 1):
        planted[key(j)] = forge(raw, mutate)
    env = lmdb.open(str(cache_root / "disk"), subdir=True, max_dbs=3, map_size=1 << 26)
    try:
        data_db = env.open_db(b"data", create=False)
        with env.begin(write=True) as txn:
            for k, value in planted.items():
                assert txn.replace(k, value, db=data_db) is not None
    finally:
        env.close()
    no_code_loading()
    with Cache(cache_root, memory=0, disk="4MiB") as cache:
        report = cache.verify()
        assert sorted(report.bad) == sorted(k.hex() for k in planted)
        for k in planted:
            assert cache.get(k) is None
            assert not cache.contains(k)  # dropped, never served again
        for i in range(n_good):
            got = cache.get(key(i))
            assert got is not None and got["input_ids"].tolist() == sample(i)["input_ids"].tolist()
        assert cache.stats()["disk"].corrupt >= len(planted)
        assert cache.verify().ok


def test_planted_entries_in_the_memory_tier_are_rejected_not_executed(
    cache_root: Path, marker: Path, no_code_loading: Callable[[], None]
) -> None:
    with Cache(cache_root, memory="1MiB", disk=None, temporary=True) as cache:
        store = cache.memory
        assert store is not None
        raw = codec.encode(sample(0))
        planted = {key(100): pickle_payload(marker, len(raw))}
        # the memory tier is not checksummed on reads (it was verified on its way
        # in): only structural forgeries are caught there, which is all that matters
        for j, mutate in enumerate(FORGERIES.values(), 101):
            planted[key(j)] = forge(raw, mutate)
        for k, value in planted.items():
            assert store.put(k, value)
        no_code_loading()
        before = store.stats().corrupt
        for k in planted:
            assert cache.get(k) is None
            assert not cache.contains(k)
        assert store.stats().corrupt - before == len(planted)


def loader_setup(
    tiny_data: Path, tokenizer_json: Path
) -> tuple[MultimodalDataset, list[dict[str, Any]], bytes, list[int]]:
    pipe = Pipeline(image=ImageSpec(size=32), text=TextSpec(tokenizer_json, max_length=16))
    ds = MultimodalDataset(tiny_data, pipeline=pipe)
    reference = list(DataLoader(ds, cache=None, batch_size=8, seed=4))
    first = [ds.records.index_of(sid) for sid in reference[0]["id"]]
    return ds, reference, codec.encode(ds.produce(0)), first


def plant(store: Any, ds: MultimodalDataset, indices: list[int], raw: bytes, marker: Path) -> None:
    """A pickle or a forged header of the right size under real sample keys."""
    # forgeries the gather can see: it compares every header byte but the checksum,
    # ctime and cost (the memory tier is trusted for content, see mmcache.cache)
    forged = [f for n, f in FORGERIES.items() if n not in ("ctime NaN", "cost negative")]
    for j, i in enumerate(indices):
        payload = (
            pickle_payload(marker, len(raw)) if j % 3 == 0 else forge(raw, forged[j % len(forged)])
        )
        assert store.put(ds.key(i), payload)


def assert_batches(got: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    assert len(got) == len(reference)
    for a, b in zip(got, reference, strict=True):
        assert a["id"] == b["id"]
        assert torch.equal(a["image"], b["image"])
        assert torch.equal(a["input_ids"], b["input_ids"])


def test_planted_memory_entries_never_reach_a_batch(
    cache_root: Path, tiny_data: Path, tokenizer_json: Path, marker: Path
) -> None:
    """The loader gathers hits straight from shared memory: planted entries under real
    sample keys are refused by the gather and produced instead. (The first batch is left
    unplanted: see the next test.)"""
    ds, reference, raw, first = loader_setup(tiny_data, tokenizer_json)
    rest = [i for i in range(len(ds)) if i not in first]
    with Cache(cache_root, memory="2MiB", disk=None, temporary=True) as cache:
        for workers in (0, 2):  # hits gathered in the consumer; misses looked up by workers
            plant(cache.memory, ds, rest, raw, marker)
            got = list(DataLoader(ds, cache=cache, batch_size=8, seed=4, num_workers=workers))
            assert_batches(got, reference)


def test_planted_memory_entries_in_the_first_batch(
    cache_root: Path, tiny_data: Path, tokenizer_json: Path, marker: Path
) -> None:
    ds, reference, raw, first = loader_setup(tiny_data, tokenizer_json)
    with Cache(cache_root, memory="2MiB", disk=None, temporary=True) as cache:
        plant(cache.memory, ds, first, raw, marker)
        assert_batches(list(DataLoader(ds, cache=cache, batch_size=8, seed=4)), reference)


HOSTILE_IDS = [
    "../../etc/passwd",
    "../../../../../../tmp/mmcache-escape",
    "/etc/passwd",
    "/tmp/mmcache-escape-abs",
    "a\u0000b",
    "\u0000",
    "..",
    ".",
    "~",
    "~/.bashrc",
    "$(touch mmcache-escape)",
    "`touch mmcache-escape`",
    "C:\\Windows\\System32\\x",
    "name\nwith newline",
    "%s%n%x",
    "x" * 10_000,
    "con",
    "🐈‍⬛/../猫",
]


def test_hostile_ids_never_become_paths(
    tmp_path: Path,
    cache_root: Path,
    tiny_data: Path,
    tokenizer_json: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # relative paths would land here
    images = [json.loads(line)["image_path"] for line in tiny_data.read_text().splitlines()]
    folder = tmp_path / "hostile"
    folder.mkdir()
    manifest = folder / "manifest.jsonl"
    with manifest.open("w", encoding="utf-8") as f:
        for i, sid in enumerate(HOSTILE_IDS):
            image = str(tiny_data.parent / images[i % len(images)])
            f.write(json.dumps({"id": sid, "image_path": image, "caption": sid}) + "\n")
    assert [read_manifest(manifest).id(i) for i in range(len(HOSTILE_IDS))] == HOSTILE_IDS
    escape = [Path("/tmp/mmcache-escape"), Path("/tmp/mmcache-escape-abs")]
    passwd = Path("/etc/passwd").stat()
    before = {p for p in tmp_path.rglob("*") if not p.is_relative_to(cache_root)}
    pipe = Pipeline(image=ImageSpec(size=32), text=TextSpec(tokenizer_json, max_length=16))
    ds = MultimodalDataset(manifest, pipeline=pipe)
    with Cache(cache_root, memory="1MiB", disk="4MiB") as cache:
        report = warm(ds, cache, progress=False)
        assert report.admitted == len(HOSTILE_IDS)
        loader = DataLoader(ds, cache=cache, batch_size=4, seed=0)
        seen = [sid for batch in loader for sid in batch["id"]]
        assert sorted(seen) == sorted(HOSTILE_IDS)
        assert loader.stats().epochs[0].hits == len(HOSTILE_IDS)
    after = {p for p in tmp_path.rglob("*") if not p.is_relative_to(cache_root)}
    assert after == before, "something was created outside the cache root"
    assert os.listdir(cwd) == []
    assert not any(p.exists() for p in escape)
    assert Path("/etc/passwd").stat().st_mtime_ns == passwd.st_mtime_ns
    inside = {str(p.relative_to(cache_root)) for p in cache_root.rglob("*")}
    fp = pipe.fingerprint()  # the registry names its files after the (hex) fingerprint only
    assert inside == {
        "cache.json",
        "root-id",
        "disk",
        "disk/data.mdb",
        "disk/lock.mdb",
        "disk/stats.i64",
        "fingerprints",
        f"fingerprints/{fp}.json",
        f"fingerprints/{fp}.keys",
    }
    name = _memory_name(cache_root.absolute())
    segments = [os.path.basename(p) for p in glob.glob(f"{store_dir()}/mmcache-{name}*")]
    assert segments and all(
        re.fullmatch(rf"mmcache-{name}(\.lock|-meta|-[di]\d{{3}})", s) for s in segments
    ), segments


def modes(root: Path) -> dict[str, int]:
    out = {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*")}
    out["."] = stat.S_IMODE(root.stat().st_mode)
    name = _memory_name(root.absolute())
    for directory in {store_dir(), store_dir(os.getegid())}:  # the user's, the group's
        for seg in glob.glob(f"{directory}/mmcache-{name}*"):
            out[os.path.basename(seg)] = stat.S_IMODE(os.stat(seg).st_mode)
    return out


@pytest.mark.parametrize("root_exists", [False, True], ids=["new-root", "existing-root"])
def test_files_and_segments_are_private_even_under_umask_0(
    cache_root: Path, root_exists: bool
) -> None:
    old = os.umask(0)
    try:
        if root_exists:
            cache_root.mkdir(mode=0o755)  # made by the user, shared on purpose: left as it is
        with Cache(cache_root, memory="1MiB", disk="1MiB") as cache:
            cache.put(key(1), sample(1))
            got = modes(cache_root)
    finally:
        os.umask(old)
    assert got.pop(".") == (0o755 if root_exists else 0o700)
    assert any(k.startswith("mmcache-") and k.endswith("-meta") for k in got)
    assert any(k.startswith("mmcache-") and "-d" in k[-5:] for k in got)
    directories = {"disk", "fingerprints"}
    for path, mode in got.items():
        assert mode == (0o700 if path in directories else 0o600), (path, oct(mode))


def test_the_user_can_ask_to_share_the_cache_with_a_group(cache_root: Path) -> None:
    cache = Cache(cache_root, memory="1MiB", disk="1MiB", mode=0o660)  # type: ignore[call-arg]
    with cache:
        cache.put(key(1), sample(1))
        got = modes(cache_root)
    assert got.pop(".") == 0o770
    for path, mode in got.items():
        assert mode == (0o770 if path in ("disk", "fingerprints") else 0o660), (path, oct(mode))


# ------------------------------------------------------------------ another local user

ATTACKER = 23402  # a numeric uid with no account; setpriv needs none


@pytest.fixture
def fake_shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A world-writable sticky folder standing for /dev/shm (so planting in it cannot
    disturb other tests), patched in as the memory tier's SHM_DIR."""
    from mmcache.stores.memory import shm as shm_mod

    base = Path(f"/dev/shm/mmcache-test-{os.urandom(6).hex()}")
    base.mkdir()
    os.chmod(base, 0o1777)
    monkeypatch.setattr(shm_mod, "SHM_DIR", str(base))
    yield base
    subprocess.run(["rm", "-rf", str(base)], check=False)


def as_user(uid: int, gid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("running as another user needs root and setpriv")
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)


def test_a_store_directory_made_by_another_user_is_refused_never_used(
    fake_shm: Path, cache_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker (a real other uid) makes the victim's store directory first, open to
    all: the victim refuses it, naming it and its owner, and with fallback="uncached"
    trains without the memory tier, saying so in the log and in stats."""
    planted = store_dir()
    assert as_user(ATTACKER, ATTACKER, "mkdir", "-m", "0777", planted).returncode == 0
    with pytest.raises(CacheError) as info:
        Cache(cache_root, memory="1MiB", disk=None)
    assert planted in str(info.value) and f"uid {ATTACKER}" in str(info.value)
    with caplog.at_level("WARNING", logger="mmcache"):
        cache = Cache(cache_root, memory="1MiB", disk=None, fallback="uncached")
    with cache:
        assert cache.memory is None
        assert f"uid {ATTACKER}" in cache.stats().degraded["memory"]
        assert cache.stats().as_dict()["degraded"]["memory"]
    assert any(planted in r.getMessage() and "uncached" in r.getMessage() for r in caplog.records)
    assert os.listdir(planted) == []  # nothing of the victim's went into it


def test_the_store_directory_keeps_other_users_out(fake_shm: Path, cache_root: Path) -> None:
    with Cache(cache_root, memory="1MiB", disk=None) as cache:
        cache.put(key(1), sample(1))
        meta = next(p for p in cache.memory.segment_paths() if p.endswith("-meta"))  # type: ignore[union-attr]
        assert stat.S_IMODE(os.stat(os.path.dirname(meta)).st_mode) == 0o700
        for argv in (["cat", meta], ["sh", "-c", f": > {os.path.dirname(meta)}/mmcache-x-meta"]):
            assert as_user(ATTACKER, ATTACKER, *argv).returncode != 0, argv


@pytest.mark.parametrize("fallback", ["raise", "uncached"])
def test_store_files_owned_by_another_user_are_refused(
    cache_root: Path, fallback: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What pre-created segments leave behind: files of another uid, mode 0666, where the
    victim's store goes. The victim must not attach (it would serve the attacker's data)."""
    with Cache(cache_root, memory="1MiB", disk=None) as cache:
        cache.put(key(1), sample(1))
        paths = cache.memory.segment_paths()  # type: ignore[union-attr]
    for path in paths:
        os.chown(path, ATTACKER, ATTACKER)
        os.chmod(path, 0o666)
    if fallback == "raise":
        with pytest.raises(CacheError) as info:
            Cache(cache_root, memory="1MiB", disk=None)
        assert f"uid {ATTACKER}" in str(info.value)
        assert any(p in str(info.value) for p in paths)
        return
    with caplog.at_level("WARNING", logger="mmcache"):
        cache = Cache(cache_root, memory="1MiB", disk=None, fallback="uncached")
    with cache:
        assert cache.memory is None and cache.get(key(1)) is None
        assert f"uid {ATTACKER}" in cache.stats().degraded["memory"]


def test_group_members_share_one_copy_of_the_memory_tier(
    fake_shm: Path,
) -> None:
    """mode=0o660 shares the memory tier with the root's group: a second member (another
    uid) finds the first one's entries in the same segments, not a copy of their own."""
    root = fake_shm / "team-cache"
    root.mkdir(mode=0o770)
    os.chmod(root, 0o770)
    with Cache(root, memory="1MiB", disk=None, mode=0o660) as alice:
        alice.put(key(1), sample(1))
        paths = alice.memory.segment_paths()  # type: ignore[union-attr]
        with pytest.MonkeyPatch.context() as other_member:  # another uid's process
            other_member.setattr(os, "getuid", lambda: ATTACKER)
            other_member.setattr(os, "geteuid", lambda: ATTACKER)
            with Cache(root, memory="1MiB", disk=None, mode=0o660) as bob:
                got, tier = bob.lookup(key(1))
                assert tier == "memory" and got is not None
                assert bob.memory.segment_paths() == paths  # type: ignore[union-attr]
    group_dir = os.path.dirname(paths[0])
    assert group_dir == store_dir(os.getegid())
    assert stat.S_IMODE(os.stat(group_dir).st_mode) == 0o770
    # really, as other uids: a member may open the segments, a non-member may not
    member = as_user(ATTACKER, os.getegid(), "sh", "-c", f"test -r {paths[1]} -a -w {paths[1]}")
    outsider = as_user(ATTACKER, ATTACKER, "cat", paths[1])
    assert member.returncode == 0 and outsider.returncode != 0
