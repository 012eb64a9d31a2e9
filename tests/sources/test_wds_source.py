"""WebDatasetSource on local shards: the source contract, bitwise equality with the same
samples as loose files, the member index, and every bad input of a tar shard."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmcache import keys
from mmcache.dataset import MultimodalDataset, open_source
from mmcache.errors import ManifestError, SampleError
from mmcache.loader import DataLoader
from mmcache.sources.base import OnError
from mmcache.sources.wds import WebDatasetSource, sniff, tablefile, write_shards
from mmcache.sources.wds.index import index_path
from mmcache.synth import make_dataset, make_image
from mmcache.testing.hostile import tar_member
from mmcache.testing.source_contract import SourceContract
from mmcache.transforms.pipeline import Pipeline


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _jpeg(index: int, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    make_image(index, seed).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """Write the tar (left alone when it already holds exactly these bytes, so that its
    stamp stays the same)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            _add(tar, name, data)
    if not path.exists() or path.read_bytes() != buf.getvalue():
        path.write_bytes(buf.getvalue())
    return path


def sample_members(key: str, index: int, *, seed: int = 0) -> list[tuple[str, bytes]]:
    return [
        (f"{key}.jpg", _jpeg(index, seed)),
        (f"{key}.json", json.dumps({"width": 1, "height": 2}).encode()),
        (f"{key}.txt", f"caption of {key}".encode()),
    ]


@pytest.fixture
def shards(tmp_path: Path) -> tuple[Path, list[Path]]:
    manifest = make_dataset(tmp_path / "data", 12, seed=3)
    return manifest, write_shards(manifest, tmp_path / "shards", per_shard=5)


# -- the contract --------------------------------------------------------------------------------


class TestWebDatasetContract(SourceContract):
    """One sample per shard, so that rewriting a shard changes exactly one sample."""

    __test__ = True

    @pytest.fixture(autouse=True)
    def _where(self, tmp_path: Path, small_pipeline: Pipeline) -> None:
        self.root = tmp_path
        self.pipeline = small_pipeline

    def _write(self, i: int, *, bad: bool = False, seed: int = 0) -> Path:
        members = sample_members(f"s{i:03d}", i, seed=seed)
        if bad:
            members[0] = (members[0][0], b"this is not a JPEG")
        return write_tar(self.root / f"{i:05d}.tar", members)

    def make_source(
        self, n: int, *, on_error: OnError = "raise", bad: int | None = None
    ) -> WebDatasetSource:
        for i in range(n):
            self._write(i, bad=i == bad)
        shards = [self.root / f"{i:05d}.tar" for i in range(n)]
        return WebDatasetSource(
            shards, pipeline=self.pipeline, on_error=on_error, index_dir=self.root / "idx"
        )

    def change_input(self, source: Any, index: int) -> None:
        os.utime(self._write(index, seed=7), ns=(1, 1))
        assert source.revalidate() == [str(self.root / f"{index:05d}.tar")]

    def make_hostile_source(
        self, images: Sequence[bytes], *, pipeline: Any, on_error: OnError
    ) -> WebDatasetSource:
        body = b"".join(tar_member(f"{i:06d}.jpg", data) for i, data in enumerate(images))
        shard = self.root / "hostile.tar"
        shard.write_bytes(body + b"\0" * 1024)
        return WebDatasetSource(shard, pipeline=pipeline, on_error=on_error, index_dir=False)


# -- reading -------------------------------------------------------------------------------------


def test_shards_equal_loose_files_bitwise(shards: Any, small_pipeline: Pipeline, tmp_path: Path):
    manifest, _paths = shards
    files = MultimodalDataset(manifest, pipeline=small_pipeline)
    src = WebDatasetSource(
        str(tmp_path / "shards" / "{00000..00002}.tar"),
        pipeline=small_pipeline,
        index_dir=tmp_path / "idx",
    )
    assert len(src) == len(files) == 12 and src.ids(range(12)) == files.ids(range(12))
    a = list(DataLoader(src, cache=None, batch_size=5, shuffle=True, seed=4))
    b = list(DataLoader(files, cache=None, batch_size=5, shuffle=True, seed=4))
    assert len(a) == len(b) == 3
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"]
        for name in ("image", "input_ids", "attention_mask"):
            assert x[name].dtype == y[name].dtype and bool((x[name] == y[name]).all()), name


def test_patterns_globs_lists_and_sniff(shards: Any, small_pipeline: Pipeline, tmp_path: Path):
    _, paths = shards
    kw: dict[str, Any] = {"pipeline": small_pipeline, "index_dir": False}
    by_glob = WebDatasetSource(str(tmp_path / "shards" / "*.tar"), **kw)
    by_list = WebDatasetSource([str(p) for p in paths], **kw)
    by_path = WebDatasetSource(paths[1], **kw)
    assert by_glob.ids(range(12)) == by_list.ids(range(12))
    assert len(by_path) == 5 and by_path.sample_id(0) == "000005"
    assert sniff("s3://b/shards/{000..009}.tar") and sniff(paths) and not sniff("m.jsonl")
    with pytest.raises(Exception, match="matches no file"):
        WebDatasetSource(str(tmp_path / "none-*.tar"), **kw)


def test_index_is_kept_by_stamp_and_reads_no_image_data(
    shards: Any, small_pipeline: Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    _, paths = shards
    idx = tmp_path / "idx"
    src = WebDatasetSource(paths, pipeline=small_pipeline, index_dir=idx)
    assert len(list(idx.glob("*" + tablefile.SUFFIX))) == 3
    # json width/height without decoding any image
    sizes = src.image_sizes(range(12))
    assert sizes.shape == (12, 2) and (sizes > 0).all()
    # a second open reads the kept index, never the tar headers
    import mmcache.sources.wds.index as index_mod

    def no_scan(*a: Any, **k: Any) -> None:
        raise AssertionError("scanned again")

    monkeypatch.setattr(index_mod, "scan", no_scan)
    again = WebDatasetSource(paths, pipeline=small_pipeline, index_dir=idx)
    np.testing.assert_array_equal(again.key_rows(range(12)), src.key_rows(range(12)))
    # a damaged index file is rebuilt, not trusted
    monkeypatch.undo()
    st = os.stat(paths[0])
    exts = (src.image_exts, src.text_exts, src.json_exts)
    bad = index_path(str(idx), str(paths[0]), keys.stat_stamp(st), exts)
    Path(bad).write_text(json.dumps({"format": "mmcache.wds-index", "version": 1}))
    rebuilt = WebDatasetSource(paths, pipeline=small_pipeline, index_dir=idx)
    np.testing.assert_array_equal(rebuilt.key_rows(range(12)), src.key_rows(range(12)))
    kept = tablefile.read(bad, location=str(paths[0]), stamp=keys.stat_stamp(st), exts=exts)
    assert kept is not None and len(kept) == 5  # written again, whole


def test_a_sample_reads_only_its_own_bytes(
    shards: Any, small_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
):
    _, paths = shards
    src = WebDatasetSource(paths, pipeline=small_pipeline, index_dir=False)
    reads: list[int] = []
    real = os.pread

    def counting(fd: int, n: int, off: int) -> bytes:
        reads.append(n)
        return real(fd, n, off)

    monkeypatch.setattr(os, "pread", counting)
    src.produce(7)
    start, end = src.span(7)
    assert reads == [end - start] and end - start < os.path.getsize(paths[1]) / 3


def test_extensions_are_configurable(tmp_path: Path, small_pipeline: Pipeline):
    write_tar(
        tmp_path / "a.tar",
        [("k1.png", _png(1)), ("k1.caption", b"hello world"), ("k1.jpg", _jpeg(2))],
    )
    src = WebDatasetSource(
        tmp_path / "a.tar",
        pipeline=small_pipeline,
        image_exts=("png", "jpg"),
        text_exts=("caption",),
        index_dir=False,
    )
    assert len(src) == 1 and src.member_name(0, "image") == "k1.png"
    assert src.produce(0)["image"].shape == (3, 64, 64)


def _png(index: int) -> bytes:
    buf = io.BytesIO()
    make_image(index).save(buf, format="PNG")
    return buf.getvalue()


# -- bad input -----------------------------------------------------------------------------------


def _loader_ids(src: WebDatasetSource) -> list[str]:
    out: list[str] = []
    for batch in DataLoader(src, cache=None, batch_size=3, shuffle=False):
        out.extend(batch["id"])
    return out


def test_truncated_tar_keeps_its_good_members(tmp_path: Path, small_pipeline: Pipeline):
    members = sample_members("a", 0) + sample_members("b", 1) + sample_members("c", 2)
    path = write_tar(tmp_path / "t.tar", members)
    data = path.read_bytes()
    # cut inside the last member (c.txt): c keeps its image but loses its text
    cut = data.rfind(b"caption of c") + 4
    path.write_bytes(data[:cut])
    for on_error in ("raise", "skip"):
        src = WebDatasetSource(path, pipeline=small_pipeline, on_error=on_error, index_dir=False)
        assert src.ids(range(len(src))) == ["a", "b", "c"]
        assert src.produce(0)["image"].shape == (3, 64, 64) and src.produce(1)
        with pytest.raises(SampleError, match="no text member") as info:
            src.produce(2)
        assert info.value.sample_id == "c" and "t.tar" in str(info.value)
    assert _loader_ids(src) == ["a", "b"]
    assert [r.sample_id for r in src.rejects()] == ["c"]


def test_a_member_that_is_not_an_image(tmp_path: Path, small_pipeline: Pipeline):
    members = sample_members("a", 0) + sample_members("b", 1)
    members[3] = ("b.jpg", b"<html>not an image</html>")
    path = write_tar(tmp_path / "t.tar", members)
    src = WebDatasetSource(path, pipeline=small_pipeline, index_dir=False)
    with pytest.raises(SampleError, match="not an image") as info:
        src.produce(1)
    assert info.value.sample_id == "b" and info.value.path == f"{path}:b.jpg"
    skip = WebDatasetSource(path, pipeline=small_pipeline, on_error="skip", index_dir=False)
    assert _loader_ids(skip) == ["a"]
    rejects = skip.rejects()
    assert [(r.sample_id, r.path) for r in rejects] == [("b", f"{path}:b.jpg")]


def test_image_without_text_and_text_without_image(tmp_path: Path, small_pipeline: Pipeline):
    path = write_tar(
        tmp_path / "t.tar",
        [("img.jpg", _jpeg(0)), ("txt.txt", b"only a caption"), *sample_members("ok", 2)],
    )
    src = WebDatasetSource(path, pipeline=small_pipeline, index_dir=False)
    assert src.ids([0, 1, 2]) == ["img", "txt", "ok"]
    with pytest.raises(SampleError, match="no text member") as info:
        src.produce(0)
    assert info.value.path == f"{path}:img.jpg"
    with pytest.raises(SampleError, match="no image member") as info:
        src.produce(1)
    assert info.value.sample_id == "txt" and str(path) in str(info.value)
    skip = WebDatasetSource(path, pipeline=small_pipeline, on_error="skip", index_dir=False)
    assert _loader_ids(skip) == ["ok"]
    assert sorted(r.sample_id for r in skip.rejects()) == ["img", "txt"]
    # an image-only pipeline takes the image without text
    image_only = Pipeline(image=small_pipeline.image)
    assert WebDatasetSource(path, pipeline=image_only, index_dir=False).produce(0)


def test_duplicate_keys_across_shards(tmp_path: Path, small_pipeline: Pipeline):
    a = write_tar(tmp_path / "a.tar", sample_members("k", 0) + sample_members("x", 1))
    b = write_tar(tmp_path / "b.tar", sample_members("k", 2) + sample_members("y", 3))
    with pytest.raises(ManifestError, match="duplicate id") as info:
        WebDatasetSource([a, b], pipeline=small_pipeline, index_dir=False)
    assert info.value.path == str(b) and info.value.sample_id == "k" and "k.jpg" in str(info.value)
    # both entries named, in the words every source uses (sources/ids.py)
    assert f"duplicate id (first seen at shard {a}, member k." in str(info.value)
    skip = WebDatasetSource([a, b], pipeline=small_pipeline, on_error="skip", index_dir=False)
    assert skip.ids(range(len(skip))) == ["k", "x", "y"]
    (rej,) = skip.rejects()
    assert rej.sample_id == "k" and rej.path == f"{b}:k.jpg" and "duplicate" in rej.reason
    # the kept "k" is the first shard's
    first = WebDatasetSource(a, pipeline=small_pipeline, index_dir=False).produce(0)
    np.testing.assert_array_equal(skip.produce(0)["image"], first["image"])


def test_an_unreadable_shard(
    tmp_path: Path, small_pipeline: Pipeline, monkeypatch: pytest.MonkeyPatch
):
    a = write_tar(tmp_path / "a.tar", sample_members("x", 0))
    b = write_tar(tmp_path / "b.tar", sample_members("y", 1))
    b.chmod(0)
    if os.geteuid() == 0:  # root reads anything: deny the open as the kernel would
        real_open = os.open  # shards are opened by mmcache.rootfiles.open_regular

        def denied(file: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(file, int) and os.fspath(file) == str(b):
                raise PermissionError(13, "Permission denied", str(b))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(os, "open", denied)
    with pytest.raises(ManifestError, match="Permission denied") as info:
        WebDatasetSource([a, b], pipeline=small_pipeline, index_dir=False)
    assert info.value.path == str(b)
    skip = WebDatasetSource([a, b], pipeline=small_pipeline, on_error="skip", index_dir=False)
    assert skip.ids(range(len(skip))) == ["x"]
    (rej,) = skip.rejects()
    assert rej.path == str(b) and "Permission denied" in rej.reason


def test_not_a_tar(tmp_path: Path, small_pipeline: Pipeline):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"\x89PNG not a tar at all" * 100)
    with pytest.raises(ManifestError, match=r"bad\.tar"):
        WebDatasetSource(bad, pipeline=small_pipeline, index_dir=False)


def test_a_changed_local_shard_is_rekeyed_on_revalidate(
    shards: Any, small_pipeline: Pipeline, tmp_path: Path
):
    _manifest, paths = shards
    src = WebDatasetSource(paths, pipeline=small_pipeline, index_dir=tmp_path / "idx")
    before = src.key_rows(range(12)).copy()
    image_before = src.produce(0)["image"]
    other = make_dataset(tmp_path / "other", 5, seed=9)
    write_shards(other, tmp_path / "new", per_shard=5)
    os.replace(tmp_path / "new" / "00000.tar", paths[0])
    assert src.revalidate() == [str(paths[0])]
    after = src.key_rows(range(12))
    assert not (after[:5] == before[:5]).all(axis=1).any()
    np.testing.assert_array_equal(after[5:], before[5:])
    assert not np.array_equal(src.produce(0)["image"], image_before)


def test_warm_epochs_of_shards_are_guessed_and_a_changed_shard_is_not_served_stale(
    shards: Any, small_pipeline: Pipeline, tmp_path: Path, cache_root: Path
):
    from mmcache.cache import Cache
    from mmcache.loader import LoaderHook

    _, paths = shards

    class Seen(LoaderHook):
        def __init__(self) -> None:
            self.guessed: dict[int, list[bool]] = {}

        def after_assemble(self, batch: dict[str, Any], ctx: Any) -> dict[str, Any]:
            self.guessed.setdefault(ctx.epoch, []).append(ctx.guessed)
            return batch

    src = WebDatasetSource(paths, pipeline=small_pipeline, index_dir=tmp_path / "idx")
    cache = Cache(cache_root, memory="32MiB", disk=None)
    seen = Seen()
    loader = DataLoader(
        src,
        cache=cache,
        batch_size=4,
        shuffle=False,
        num_workers=1,
        persistent_workers=True,
        hooks=[seen],
    )
    try:
        first = [b["image"].clone() for b in loader]
        warm = [b["image"].clone() for b in loader]
        assert seen.guessed[1] and all(seen.guessed[1]), "a warm epoch of shards is not guessed"
        for a, b in zip(first, warm, strict=True):
            assert bool((a == b).all())
        # shard 0 replaced by other images under the same keys, then revalidated
        other = make_dataset(tmp_path / "other", 5, seed=9)
        write_shards(other, tmp_path / "new", per_shard=5)
        os.replace(tmp_path / "new" / "00000.tar", paths[0])
        assert src.revalidate() == [str(paths[0])]
        after = [row for b in loader for row in b["image"]]
        fresh = WebDatasetSource(paths[0], pipeline=small_pipeline, index_dir=False)
        for j in range(5):
            np.testing.assert_array_equal(after[j].numpy(), fresh.produce(j)["image"])
        np.testing.assert_array_equal(after[5].numpy(), first[1][1].numpy())
    finally:
        loader.close()
        cache.close()


def test_open_source_takes_a_source_object(shards: Any, small_pipeline: Pipeline):
    import pickle

    manifest, paths = shards
    src = WebDatasetSource(paths, pipeline=small_pipeline, index_dir=False)
    assert open_source(src) is src
    assert open_source(src, pipeline=small_pipeline) is src
    with pytest.raises(Exception, match="pipeline differs"):
        open_source(src, pipeline=Pipeline(image=small_pipeline.image))
    ds = MultimodalDataset(manifest, pipeline=small_pipeline)  # a manifest: as before
    assert isinstance(ds, MultimodalDataset)
    assert pickle.loads(pickle.dumps(ds)).ids(range(3)) == ds.ids(range(3))


def test_open_source_opens_shards_by_path(shards: Any, small_pipeline: Pipeline) -> None:
    """A ``.tar`` path (or glob) is sniffed as WebDataset shards: the same samples."""
    manifest, paths = shards
    files = MultimodalDataset(manifest, pipeline=small_pipeline)
    ds = open_source(str(paths[0].parent / "*.tar"), pipeline=small_pipeline)
    assert len(ds) == len(files)
    got = {ds.sample_id(i): ds.produce(i) for i in range(len(ds))}
    for i in range(len(files)):
        want = files.produce(i)
        assert all(np.array_equal(got[files.sample_id(i)][k], v) for k, v in want.items())


def test_errors_name_the_text_member_of_a_configured_extension(
    tmp_path: Path, small_pipeline: Pipeline
):
    path = write_tar(tmp_path / "a.tar", [("k.jpg", _jpeg(0)), ("k.caption", b"\xff\xfe bad")])
    src = WebDatasetSource(path, pipeline=small_pipeline, text_exts=("caption",), index_dir=False)
    with pytest.raises(SampleError, match="not UTF-8") as info:
        src.produce(0)
    assert info.value.path == f"{path}:k.caption"
