"""The synthetic source of the control-plane simulation passes the SampleSource contract."""

from __future__ import annotations

import numpy as np
import pytest

from mmcache.errors import ConfigError
from mmcache.sources.base import OnError, SampleSource, StampKind
from mmcache.testing.source_contract import SourceContract
from mmcache.testing.synthetic import SyntheticPipeline, SyntheticSource


class TestSyntheticFileStamps(SourceContract):
    __test__ = True
    stamp_kind = StampKind.FILE
    ids = "strings"

    def make_source(
        self, n: int, *, on_error: OnError = "raise", bad: int | None = None
    ) -> SampleSource:
        return SyntheticSource(
            n, ids=self.ids, stamp_kind=self.stamp_kind, on_error=on_error, bad=bad
        )

    def change_input(self, source: SampleSource, index: int) -> None:
        assert isinstance(source, SyntheticSource)
        source.touch(index)


class TestSyntheticFixedStampsAndPositions(TestSyntheticFileStamps):
    stamp_kind = StampKind.FIXED
    ids = "positions"


def test_ids_are_fixed_width_and_the_same_at_every_size() -> None:
    small, big = SyntheticSource(3), SyntheticSource(3_000_001)
    assert small.ids([0, 2]) == ["s0000000000", "s0000000002"]
    assert big.ids([2, 3_000_000]) == ["s0000000002", "s0003000000"]  # across id chunks
    np.testing.assert_array_equal(small.key_rows([0, 1, 2]), big.key_rows([0, 1, 2]))
    assert big.nbytes == 3_000_001 * 19 + 8


def test_the_pipeline_version_changes_every_key() -> None:
    one = SyntheticSource(4).key_rows([0, 1, 2, 3])
    two = SyntheticSource(4, pipeline=SyntheticPipeline(version=2)).key_rows([0, 1, 2, 3])
    assert not (one == two).all(axis=1).any()


@pytest.mark.parametrize(
    "kwargs",
    [{"n": -1}, {"n": 2.0}, {"n": 3, "ids": "uuid"}, {"n": 3, "stamp_kind": StampKind.CONTENT}],
)
def test_bad_arguments_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        SyntheticSource(**kwargs)  # type: ignore[arg-type]
