"""The contract every :class:`~mmcache.sources.base.SampleSource` must pass, as a pytest base class.

Subclass it in a test module, set ``__test__ = True`` and implement
:meth:`SourceContract.make_source` and :meth:`SourceContract.change_input`::

    class TestMySource(SourceContract):
        __test__ = True

        @pytest.fixture(autouse=True)
        def _where(self, tmp_path):
            self.root = tmp_path

        def make_source(self, n, *, on_error="raise", bad=None):
            return MySource(write_samples(self.root, n, broken=bad), on_error=on_error)

        def change_input(self, source, index):
            rewrite_sample(self.root, index)

The sources it makes are small (a handful of samples): a source runs the whole
suite in seconds.

Rules checked beyond the protocol's docstrings: ids are strings and ``ids`` agrees
with ``sample_id``; stamps are ``int64 [n, k]`` with ``k`` fixed; keys are 16 bytes,
distinct per sample, stable while nothing changes, equal between :meth:`key_rows`
and :meth:`key` (in any order, with repeats, with or without ``stamps=``), and
a changed input changes its sample's key and no other; ``produce`` gives a dict of
numpy arrays, the same each time; a sample that cannot be produced raises
:class:`~mmcache.errors.SampleError` naming it, which ``record_reject`` accepts; a
copy in a spawned worker process (:mod:`mmcache.testing.spawned`) answers
everything the same; each capability the source claims (:mod:`mmcache.sources.capabilities`)
keeps its shapes, and :func:`~mmcache.dataset.open_source` gives the source itself
(:mod:`mmcache.testing.capability_contract`); and a source that reads containers
(shards, Parquet files) implements ``make_hostile_source`` to run the hostile-input part
(:class:`~mmcache.testing.hostile.HostileInputContract`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import pytest

from mmcache.errors import SampleError
from mmcache.sources.base import OnError, SampleSource, StampKind
from mmcache.testing.capability_contract import (
    FaceContract,
    FieldLayoutContract,
    ForeseesReadsContract,
    HasLengthsContract,
    HasRejectsContract,
    RevalidatingContract,
)
from mmcache.testing.hostile import HostileInputContract
from mmcache.testing.spawned import spawned_worker

__all__ = ["SourceContract"]

#: Samples in the sources the suite makes (enough for order and repeats to matter).
N = 6


def _answers(source: SampleSource, indices: Sequence[int], bad: int) -> dict[str, Any]:
    """What a worker computes with its copy of ``source`` (run in a spawned process)."""
    out: dict[str, Any] = {
        "len": len(source),
        "ids": source.ids(indices),
        "ids_digest": source.ids_digest(),
        "fingerprint": source.fingerprint(),
        "stamp_kind": source.stamp_kind,
        "on_error": source.on_error,
        "stamps": source.stamps(indices),
        "keys": source.key_rows(indices),
        "sample": source.produce(0),
    }
    try:
        source.produce(bad)
    except SampleError as err:
        source.record_reject(err)  # a worker records into the parent's log
        out["bad"] = err.sample_id
    return out


def _same_sample(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a
    )


class SourceContract(
    HasLengthsContract,
    FieldLayoutContract,
    HasRejectsContract,
    RevalidatingContract,
    ForeseesReadsContract,
    FaceContract,
    HostileInputContract,
):
    """Contract tests for a :class:`SampleSource`; subclasses provide the source. The
    capability mixins (:mod:`mmcache.testing.capability_contract`) check each capability
    the source claims, and that open_source gives the source itself; the hostile-input part
    runs for a source whose class implements ``make_hostile_source``."""

    __test__ = False

    def make_source(
        self, n: int, *, on_error: OnError = "raise", bad: int | None = None
    ) -> SampleSource:
        """A new source of ``n`` samples; sample ``bad`` (if given) cannot be produced.

        Two calls with the same arguments describe the same samples (same ids in the
        same order, same inputs).
        """
        raise NotImplementedError

    def change_input(self, source: SampleSource, index: int) -> None:
        """Change the input of sample ``index`` of ``source`` (its image, its bytes...), so
        that its key must change."""
        raise NotImplementedError

    # ------------------------------------------------------------------ plumbing

    @pytest.fixture(scope="class")
    @classmethod
    def worker(cls) -> Iterator[ProcessPoolExecutor]:
        """A spawn-started worker process (one per test class)."""
        with spawned_worker() as pool:
            yield pool

    def _source(self, *, on_error: OnError = "raise", bad: int | None = None) -> SampleSource:
        source = self.make_source(N, on_error=on_error, bad=bad)
        assert isinstance(source, SampleSource), "the source does not have the protocol's members"
        return source

    # ------------------------------------------------------------------ which sample

    def test_len_and_ids(self) -> None:
        source = self._source()
        assert len(source) == N
        ids = source.ids(list(range(N)))
        assert ids == [source.sample_id(i) for i in range(N)]
        assert all(isinstance(s, str) for s in ids)
        assert len(set(ids)) == N, "ids must be distinct"
        assert source.ids(np.array([3, 0, 3], dtype=np.int64)) == [ids[3], ids[0], ids[3]]
        assert source.ids([]) == []
        with pytest.raises(IndexError):
            source.ids([N])

    def test_ids_digest(self) -> None:
        source = self._source()
        digest = source.ids_digest()
        assert isinstance(digest, str) and digest
        assert source.ids_digest() == digest
        assert self._source().ids_digest() == digest  # the same samples, made again
        assert self.make_source(N - 1).ids_digest() != digest

    def test_fingerprint_and_describe(self) -> None:
        source = self._source()
        fingerprint = source.fingerprint()
        assert isinstance(fingerprint, str) and fingerprint
        assert source.fingerprint() == fingerprint == self._source().fingerprint()
        assert isinstance(source.describe(), str) and source.describe()

    def test_stamp_kind_and_on_error(self) -> None:
        source = self._source()
        assert isinstance(source.stamp_kind, StampKind)
        assert source.on_error == "raise"
        assert self._source(on_error="skip").on_error == "skip"

    def test_stamps_shape_and_dtype(self) -> None:
        source = self._source()
        stamps = source.stamps(list(range(N)))
        assert isinstance(stamps, np.ndarray) and stamps.dtype == np.int64
        assert stamps.ndim == 2 and stamps.shape[0] == N and stamps.shape[1] >= 1
        width = stamps.shape[1]
        assert source.stamps([]).shape == (0, width)
        again = source.stamps(np.array([2, 0, 2], dtype=np.int64))
        assert again.shape == (3, width)
        np.testing.assert_array_equal(again, stamps[[2, 0, 2]])  # nothing changed meanwhile
        with pytest.raises(IndexError):
            source.stamps([N])

    # ------------------------------------------------------------------ keys

    def test_key_rows_shape_and_equal_to_key(self) -> None:
        source = self._source()
        idx = [4, 0, 5, 4, 1]
        rows = source.key_rows(idx)
        assert isinstance(rows, np.ndarray) and rows.dtype == np.uint8 and rows.shape == (5, 16)
        assert [r.tobytes() for r in rows] == [source.key(i) for i in idx]
        assert all(isinstance(source.key(i), bytes) and len(source.key(i)) == 16 for i in idx)
        assert source.key_rows([]).shape == (0, 16)
        with pytest.raises(IndexError):
            source.key_rows([N])

    def test_keys_are_distinct_and_stable(self) -> None:
        source = self._source()
        everything = list(range(N))
        first = source.key_rows(everything)
        assert len({r.tobytes() for r in first}) == N, "two samples share a key"
        np.testing.assert_array_equal(source.key_rows(everything), first)  # from a memo or not
        np.testing.assert_array_equal(self._source().key_rows(everything), first)
        stamps = source.stamps(everything)
        np.testing.assert_array_equal(source.key_rows(everything, stamps=stamps), first)

    def test_changed_input_changes_only_its_key(self) -> None:
        source = self._source()
        everything = list(range(N))
        before = source.key_rows(everything).copy()
        stamps_before = source.stamps(everything)
        self.change_input(source, 2)
        after = source.key_rows(everything)
        assert after[2].tobytes() != before[2].tobytes(), "a changed input kept its key"
        assert after[2].tobytes() == source.key(2)
        np.testing.assert_array_equal(np.delete(after, 2, axis=0), np.delete(before, 2, axis=0))
        if source.stamp_kind is StampKind.FILE:
            stamps_after = source.stamps(everything)
            assert not np.array_equal(stamps_after[2], stamps_before[2])
            np.testing.assert_array_equal(
                np.delete(stamps_after, 2, axis=0), np.delete(stamps_before, 2, axis=0)
            )

    # ------------------------------------------------------------------ produce

    def test_produce_gives_arrays(self) -> None:
        source = self._source()
        for i in (0, N - 1):
            sample = source.produce(i)
            assert isinstance(sample, dict) and sample
            for name, array in sample.items():
                assert isinstance(name, str) and isinstance(array, np.ndarray), name
            assert _same_sample(source.produce(i), sample), "produce is not deterministic"
            item = source.to_item(i, sample)
            assert item["id"] == source.sample_id(i)
            assert set(sample) <= set(item)

    def test_to_item_of_read_only_arrays(self) -> None:
        source = self._source()
        sample = source.produce(1)
        for array in sample.values():
            array.flags.writeable = False  # as a cache view is
        item = source.to_item(1, sample)
        assert item["id"] == source.sample_id(1) and set(sample) <= set(item)

    def test_bad_sample_raises_and_is_recorded_under_skip(self) -> None:
        modes: tuple[OnError, ...] = ("raise", "skip")
        for on_error in modes:
            source = self._source(on_error=on_error, bad=3)
            with pytest.raises(SampleError) as info:
                source.produce(3)
            assert info.value.sample_id == source.sample_id(3)
            source.produce(2)  # the others are fine
            assert len(source.key_rows(list(range(N)))) == N  # a bad sample still has a key
        source.record_reject(info.value)  # the caller records it under "skip"

    # ------------------------------------------------------------------ processes

    def test_a_spawned_worker_answers_the_same(self, worker: ProcessPoolExecutor) -> None:
        source = self._source(on_error="skip", bad=3)
        everything = list(range(N))
        got = worker.submit(_answers, source, everything, 3).result(timeout=300)
        assert got["len"] == N and got["ids"] == source.ids(everything)
        assert got["ids_digest"] == source.ids_digest()
        assert got["fingerprint"] == source.fingerprint()
        assert got["stamp_kind"] is source.stamp_kind and got["on_error"] == source.on_error
        np.testing.assert_array_equal(got["stamps"], source.stamps(everything))
        np.testing.assert_array_equal(got["keys"], source.key_rows(everything))
        assert _same_sample(got["sample"], source.produce(0))
        assert got["bad"] == source.sample_id(3)
