"""The identity of bytes (mmcache.sources.identity): equal on copies, different when bytes differ.

- a ``cp -a`` copy of a dataset elsewhere (other inodes and ctimes, same relative names,
  sizes, mtimes and bytes) has the same keys: what ``scope="cluster"`` with node-local
  copies needs (G17);
- a ``chmod`` or a rename changes the local evidence, which leads to a content check and
  keeps the key of unchanged bytes;
- the ledger remembers digests across processes and ledgers, and a broken ledger file
  costs a re-read, never a wrong key.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmcache import keys
from mmcache.dataset import MultimodalDataset
from mmcache.sources import identity
from mmcache.sources.coco import CocoSource
from mmcache.testing.identity_contract import IdentityContract
from mmcache.testing.tabular import write_coco
from mmcache.transforms.pipeline import Pipeline

MTIME_NS = 1_600_000_000_000_000_000  # as `tar x` restores it


@pytest.fixture
def own_data(tmp_path: Path, tiny_data: Path) -> Path:
    """A copy of the session's tiny dataset that a test may rewrite (``cp -a``)."""
    shutil.copytree(tiny_data.parent, tmp_path / "own", copy_function=shutil.copy2)
    return tmp_path / "own" / tiny_data.name


def _keys(manifest: Path, pipeline: Pipeline) -> list[bytes]:
    ds = MultimodalDataset(manifest, pipeline=pipeline)
    return [r.tobytes() for r in ds.key_rows(np.arange(len(ds)))]


def test_a_cp_a_copy_elsewhere_has_the_same_keys(
    tmp_path: Path, tiny_data: Path, small_pipeline: Pipeline
) -> None:
    copy = tmp_path / "node-b" / "data"
    shutil.copytree(tiny_data.parent, copy, copy_function=shutil.copy2)  # cp -a
    first = _keys(tiny_data, small_pipeline)
    st_a = os.stat(MultimodalDataset(tiny_data, pipeline=small_pipeline).records.image_path(0))
    ds_b = MultimodalDataset(copy / tiny_data.name, pipeline=small_pipeline)
    st_b = os.stat(ds_b.records.image_path(0) or "")
    assert st_a.st_ino != st_b.st_ino  # other local evidence
    assert _keys(copy / tiny_data.name, small_pipeline) == first
    assert [ds_b.key(i) for i in range(len(ds_b))] == first  # key() agrees with key_rows


def test_chmod_and_rename_keep_the_key_of_unchanged_bytes(
    own_data: Path, small_pipeline: Pipeline
) -> None:
    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    before = ds.key_rows([0, 1]).copy()
    path = Path(ds.records.image_path(0) or "")
    ino = path.stat().st_ino
    os.chmod(path, 0o600)
    copied = path.with_suffix(".tmp")
    shutil.copy2(path, copied)  # a new inode with the same bytes and mtime, renamed over it
    os.replace(copied, path)
    assert path.stat().st_ino != ino
    np.testing.assert_array_equal(ds.key_rows([0, 1]), before)
    assert ds.key(0) == before[0].tobytes()


def test_a_same_size_rewrite_with_mtime_restored_gets_a_new_key(
    own_data: Path, small_pipeline: Pipeline
) -> None:
    ds = MultimodalDataset(own_data, pipeline=small_pipeline)
    before = ds.key_rows([0]).copy()
    path = Path(ds.records.image_path(0) or "")
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert ds.key_rows([0])[0].tobytes() != before[0].tobytes()
    # a new source (a restart) agrees: the ledger is keyed by the new evidence
    assert _keys(own_data, small_pipeline)[0] == ds.key(0)


def test_identity_is_the_content_digest(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(b"abc" * 1000)
    assert identity.file_identity(path) == keys.source_stamp(path, content=True)
    assert identity.file_identity(path, content=True) == keys.source_stamp(path, content=True)
    assert identity.file_identity(None) == "none"
    assert identity.file_identity(tmp_path / "gone") == "missing"


def test_the_ledger_is_shared_by_ledgers_of_one_file_and_survives_damage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "x.bin"
    path.write_bytes(b"q" * 4096)
    fields = keys.stat_fields(path.stat())
    ev = identity.evidence(str(path), fields)

    def later() -> float:  # digests taken once the file's stamp is no longer racy
        return fields[2] / 1e9 + identity.RACY_SECONDS + 1

    book = identity.Ledger(str(tmp_path / "l" / "ledger.sqlite"), clock=later)
    book.put_many([(ev, b"\x01" * 16, str(path), fields, None)])
    again = identity.Ledger(book.path, clock=later)
    assert again.get_many([ev, b"\x00" * 16]) == [b"\x01" * 16, None]
    # a damaged file: one warning, rebuilt empty (never an exception, never a wrong digest)
    assert book.path is not None
    Path(book.path).write_bytes(b"not a database" * 100)
    for name in ("-wal", "-shm"):
        Path(book.path + name).unlink(missing_ok=True)
    broken = identity.Ledger(book.path, clock=later)
    assert broken.get_many([ev]) == [None]
    broken.put_many([(ev, b"\x02" * 16, str(path), fields, None)])
    assert broken.get_many([ev]) == [b"\x02" * 16]
    assert "was damaged" in caplog.text and "cannot be used" not in caplog.text
    rows = sqlite3.connect(book.path).execute("SELECT d FROM digest").fetchall()
    assert rows == [(b"\x02" * 16,)]  # the rebuilt ledger holds what was learned since


def test_off_keeps_the_ledger_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MMCACHE_IDENTITY_DIR", "off")
    assert identity.ledger().path is None


class TestFileSourceIdentity(IdentityContract):
    """Loose files: fixed-size BMPs extracted with their mtimes (``tar x``)."""

    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, small_pipeline: Pipeline) -> None:
        self.pipeline = small_pipeline

    def write_dataset(self, folder: Path, variant: int) -> Path:
        (folder / "images").mkdir(parents=True, exist_ok=True)
        rows = []
        for i in range(6):
            pixels = np.random.default_rng(variant * 100 + i).integers(0, 256, (32, 32, 3))
            path = folder / "images" / f"{i:04d}.bmp"
            Image.fromarray(pixels.astype(np.uint8)).save(path, format="BMP")
            os.utime(path, ns=(MTIME_NS, MTIME_NS))
            rows.append({"id": f"{i:04d}", "image_path": f"images/{i:04d}.bmp", "caption": "a cat"})
        manifest = folder / "manifest.jsonl"
        manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.utime(manifest, ns=(MTIME_NS, MTIME_NS))
        return manifest

    def open_source(self, location: Path) -> MultimodalDataset:
        return MultimodalDataset(location, pipeline=self.pipeline)


class TestCocoSourceIdentity(TestFileSourceIdentity):
    """COCO captions over the same fixed-size BMPs (the annotation file's mtime restored)."""

    def write_dataset(self, folder: Path, variant: int) -> Path:
        manifest = super().write_dataset(folder, variant)
        coco = write_coco(manifest, folder / "captions.json")
        os.utime(coco, ns=(MTIME_NS, MTIME_NS))
        return coco

    def open_source(self, location: Path) -> CocoSource:  # type: ignore[override]
        return CocoSource(location, pipeline=self.pipeline, per="image")


def test_the_ledger_answers_a_batch_in_one_query_per_500_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new process keys every file of its first epoch's batches from the ledger: one
    SQL statement per key cost ~15 us each in the training process, one per batch ~2 us
    a key. Same answers: known keys in any order, repeated ones, unknown ones (None)."""
    statements: list[str] = []
    opened = identity._open_ledger

    def traced(path: str) -> sqlite3.Connection:
        conn = opened(path)
        conn.set_trace_callback(statements.append)
        return conn

    monkeypatch.setattr(identity, "_open_ledger", traced)
    where = str(tmp_path / "l" / "ledger.sqlite")
    rows = [
        (keys.digest("ev", i), keys.digest("d", i), f"/data/{i}.jpg", (i, 1, 2, 3), None)
        for i in range(1200)
    ]
    identity.Ledger(where).put_many(rows)
    rng = np.random.default_rng(0)
    order = rng.permutation(1200).tolist()
    asked = [rows[i][0] for i in order] + [rows[7][0], keys.digest("unknown")]
    statements.clear()
    got = identity.Ledger(where).get_many(asked)  # a new ledger: nothing in its memory
    assert got == [rows[i][1] for i in order] + [rows[7][1], None]
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert len(selects) == 3  # 1,202 keys: 500 + 500 + 202 (one per key on main: 1,202)


def test_a_process_keeps_a_bounded_number_of_digests_beside_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each digest a process learnt stayed in its memory (~200 B per file read: a worker's
    memory grew with the dataset). Beside a usable ledger file it keeps only its newest
    ``MEM_ROWS``; an older digest is read back from the file, and a ledger in memory only
    (nothing else remembers) keeps them all."""
    monkeypatch.setattr(identity, "MEM_ROWS", 100)
    old = 1_000_000_000 * 10**9  # stamps long before the digests were taken: they vouch

    def rows(n: int) -> list[identity.Learned]:
        return [
            (b"e%07d" % i, b"d%015d" % i, f"/data/f{i}", (10, old, old, i), None) for i in range(n)
        ]

    ledger = identity.Ledger(str(tmp_path / "ledger.sqlite"))
    for at in range(0, 300, 50):
        ledger.put_many(rows(300)[at : at + 50])
    assert len(ledger._mem) <= 100  # 300 before
    assert ledger.get_many([b"e%07d" % i for i in range(300)]) == [
        b"d%015d" % i for i in range(300)
    ]
    in_memory = identity.Ledger(None)
    in_memory.put_many(rows(300))
    assert len(in_memory._mem) == 300
