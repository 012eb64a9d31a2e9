"""A shuffled cold epoch over a Parquet file larger than ``row_group_memory``: the loader
tells each producing process what it produces next, so row groups are read a bounded
number of times (not once per sample), with the same batches as torch's DataLoader."""

from __future__ import annotations

import io
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from test_tabular_sources import parquet_table

from mmcache.cache import Cache
from mmcache.loader import DataLoader
from mmcache.sampler import EpochSampler
from mmcache.sources.parquet import ParquetSource
from mmcache.synth import synth_captions
from mmcache.transforms import ImageSpec, TextSpec, train_tokenizer
from mmcache.transforms.pipeline import Pipeline

N, GROUP = 1200, 40  # 30 row groups of ~42 KiB decoded: ~1.25 MiB in all
BUDGET = 448 * 1024  # a third of the groups; a quarter of the rows kept (~1.5 KiB each)
BATCH = 32


@pytest.fixture(scope="module")
def pipeline() -> Pipeline:
    tok = train_tokenizer(synth_captions(100, seed=0), vocab_size=120)
    return Pipeline(image=ImageSpec(size=8), text=TextSpec(tok, max_length=4))


def _jpeg(i: int) -> bytes:
    arr = np.full((8, 8, 3), i % 256, dtype=np.uint8)
    arr[0, 0, 1] = (i * 7) % 256
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=80)
    return buf.getvalue()


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("foresight") / "rows.parquet"
    # Padded captions: each row ~600 B, so the groups' bytes outgrow the budget.
    captions = [f"caption {i} " + "x" * 400 for i in range(N)]
    table = parquet_table([f"s{i}" for i in range(N)], [_jpeg(i) for i in range(N)], captions)
    pq.write_table(table, path, row_group_size=GROUP)
    return path


@pytest.fixture
def group_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Row groups read by every process from now on (forked workers share the count)."""
    count = multiprocessing.get_context("fork").Value("l", 0)
    original = pq.ParquetFile.read_row_group

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        with count.get_lock():
            count.value += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counting)
    yield count


def _source(path: Path, pipeline: Pipeline, row_group_memory: int | str = BUDGET) -> ParquetSource:
    return ParquetSource(
        path, pipeline=pipeline, columns={"id": "id"}, row_group_memory=row_group_memory
    )


def _torch_epoch(ds: ParquetSource, seed: int, epoch: int) -> list[dict[str, Any]]:
    """The same order through torch's DataLoader (``ds[i]`` each, default collate)."""
    order = EpochSampler(len(ds), seed=seed, shuffle=True).indices(epoch)
    batches = [order[i : i + BATCH].tolist() for i in range(0, len(order), BATCH)]
    return list(torch.utils.data.DataLoader(ds, batch_sampler=batches))


def _same(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert len(got) == len(expected)
    for x, y in zip(got, expected, strict=True):
        assert list(x["id"]) == list(y["id"])
        for name in ("image", "input_ids", "attention_mask"):
            assert torch.equal(x[name], y[name]), name


def test_parquet_foresees_reads() -> None:
    from mmcache.sources.capabilities import ForeseesReads

    assert issubclass(ParquetSource, ForeseesReads)


@pytest.mark.parametrize("mode", [(0, True), (2, True), (0, False)], ids=["here", "fork", "bare"])
def test_a_shuffled_cold_epoch_reads_each_group_a_bounded_number_of_times(
    rows_file: Path, pipeline: Pipeline, group_reads: Any, tmp_path: Path, mode: tuple[int, bool]
) -> None:
    """``mode``: the workers, and whether there is a cache (``bare``: none)."""
    workers, cached = mode
    groups = N // GROUP
    expected = _torch_epoch(_source(rows_file, pipeline), seed=5, epoch=0)
    without = group_reads.value
    assert without > N // 2  # torch's loader (no foresight): a group for most rows
    ds = _source(rows_file, pipeline)
    kwargs: dict[str, Any] = {}
    if workers:
        kwargs = {"num_workers": workers, "multiprocessing_context": "fork"}
    with Cache(tmp_path / "c", memory="64MiB", disk=None, temporary=True) as cache:
        loader = DataLoader(ds, cache=cache if cached else None, batch_size=BATCH, seed=5, **kwargs)
        loader.set_epoch(0)
        group_reads.value = 0
        got = list(loader)
        reads = group_reads.value
    _same(got, expected)
    # ~rows kept / budget (4), and a few more with workers (each reads its own share)
    assert reads <= groups * (5 + workers), (reads, without)


def test_rows_kept_stay_within_the_budget(rows_file: Path, pipeline: Pipeline) -> None:
    ds = _source(rows_file, pipeline)
    order = EpochSampler(N, seed=1, shuffle=True).indices(0)
    ds.foresee(order)
    peak = 0
    for position, index in enumerate(order.tolist()):
        ds.reached(position)
        ds.produce(index)
        kept = ds._foresight.nbytes + ds._group_bytes
        largest = max(t.nbytes for t in ds._groups.values())
        peak = max(peak, kept)
        assert kept <= BUDGET + largest  # the budget, and at least the group just read
    assert peak > BUDGET // 2  # the budget was used (rows were kept)
    assert ds.group_reads <= (N // GROUP) * 5


def test_a_row_error_under_skip_is_the_same_with_foresight(
    tmp_path: Path, pipeline: Pipeline
) -> None:
    n = 200
    images: list[bytes | None] = [_jpeg(i) for i in range(n)]
    images[17] = None  # a null image: skipped, listed
    images[90] = b"not a jpeg"
    path = tmp_path / "bad.parquet"
    pq.write_table(
        parquet_table([f"s{i}" for i in range(n)], images, [f"c{i}" for i in range(n)]),
        path,
        row_group_size=10,
    )
    ds = ParquetSource(
        path, pipeline=pipeline, columns={"id": "id"}, on_error="skip", row_group_memory=4096
    )
    loader = DataLoader(ds, cache=None, batch_size=16, seed=2)
    ids = [i for batch in loader for i in batch["id"]]
    assert len(ids) == n - 2 and "s17" not in ids and "s90" not in ids
    assert {r.sample_id for r in ds.rejects()} == {"s17", "s90"}


def test_a_rewritten_file_is_not_served_from_kept_rows(tmp_path: Path, pipeline: Pipeline) -> None:
    path = tmp_path / "rw.parquet"
    n = 40
    table = parquet_table(
        [f"s{i}" for i in range(n)], [_jpeg(i) for i in range(n)], [f"c{i}" for i in range(n)]
    )
    pq.write_table(table, path, row_group_size=10)
    # A budget below the groups' bytes (~26 KiB): rows are kept (~8 KiB for group 0's).
    ds = ParquetSource(path, pipeline=pipeline, columns={"id": "id"}, row_group_memory="16KiB")
    ds.foresee(np.arange(n))
    ds.produce(0)  # group 0 read: rows 1-9 kept for their turn
    assert len(ds._foresight) == 9
    rewritten = table.set_column(2, "text", pa.array([f"new {i}" for i in range(n)]))
    pq.write_table(rewritten, path, row_group_size=10)
    import os

    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    fresh = ParquetSource(path, pipeline=pipeline, columns={"id": "id"})
    for i in range(1, 10):
        np.testing.assert_array_equal(ds.produce(i)["input_ids"], fresh.produce(i)["input_ids"])


def test_foresight_evicts_the_row_needed_last() -> None:
    from mmcache.sources.foresight import Foresight

    f = Foresight(budget=30)
    f.foresee(np.array([5, 6, 7, 8]))
    assert f.keep(8, 3, "d", 10) and f.keep(7, 2, "c", 10) and f.keep(6, 1, "b", 10)
    assert not f.keep(9, 4, "x", 10)  # farther than every kept row: not kept
    assert f.keep(5, 0, "a", 10)  # sooner: the farthest (row 8) goes
    assert f.take(8) is None and f.take(5) == "a"
    f.reached(2)  # row 6's turn went by unread: dropped
    assert f.take(6) is None and f.take(7) == "c" and f.nbytes == 0


class _Told:
    """A ForeseesReads source that records what it is told."""

    def __init__(self) -> None:
        self.told: list[Any] = []

    def foresee(self, indices: np.ndarray) -> None:
        self.told.append(("foresee", np.asarray(indices).tolist()))

    def reached(self, position: int) -> None:
        self.told.append(("reached", position))


def test_a_stretch_on_the_stride_is_foreseen_and_a_lone_batch_is_not() -> None:
    from mmcache.loader.lookahead import Lookahead

    order = [np.arange(k * 2, k * 2 + 2) for k in range(8)]  # 8 batches of 2
    asked: list[int] = []

    def batches(epoch: int) -> list[np.ndarray]:
        asked.append(epoch)
        return order

    source = _Told()
    ahead = Lookahead(source, batches)
    ahead.follow(0, 1, order[1])  # a lone batch: nothing computed, nothing told
    assert asked == [] and source.told == []
    ahead.follow(0, 2, order[2])  # the next on the stride (1 here): foresee from it
    assert asked == [0] and source.told == [("foresee", list(range(4, 16)))]
    ahead.follow(0, 4, order[4])  # a batch with no miss in between: where it has got to
    assert source.told[-1] == ("reached", 4)
    ahead.follow(1, 0, order[0])  # another epoch: the foresight is dropped, until confirmed
    assert source.told[-1] == ("foresee", []) and asked == [0]
    ahead.follow(1, 1, np.array([9, 9]))  # not the order's batch: nothing foreseen
    assert source.told[-1] == ("foresee", []) and asked == [0, 1]


def test_a_source_without_the_capability_is_told_nothing() -> None:
    from mmcache.loader.lookahead import Lookahead

    def batches(epoch: int) -> list[np.ndarray]:
        raise AssertionError("the order is not computed for such a source")

    ahead = Lookahead(object(), batches)
    ahead.follow(0, 0, np.arange(2))
    ahead.follow(0, 1, np.arange(2, 4))


def test_groups_that_fit_the_budget_are_read_once_and_no_row_is_kept(
    rows_file: Path, pipeline: Pipeline
) -> None:
    ds = _source(rows_file, pipeline, row_group_memory="8MiB")  # all 30 groups fit
    order = EpochSampler(N, seed=1, shuffle=True).indices(0)
    ds.foresee(order)
    for position, index in enumerate(order.tolist()):
        ds.reached(position)
        ds.produce(index)
        assert len(ds._foresight) == 0  # the LRU holds every group: nothing copied out
    assert ds.group_reads == N // GROUP


def test_foresight_heaps_stay_bounded_by_the_rows_kept() -> None:
    from mmcache.sources.foresight import Foresight

    f = Foresight(budget=1 << 30)
    f.foresee(np.arange(10_000))
    for row in range(10_000):  # each row kept, then taken at its turn
        assert f.keep(row, row, row, 1)
        assert f.take(row) == row
    assert len(f) == 0 and len(f._far) <= 1024 + 2 and len(f._near) <= 1024 + 2
