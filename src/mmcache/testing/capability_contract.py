"""One contract mixin per source capability (:mod:`mmcache.sources.capabilities`).

:class:`~mmcache.testing.source_contract.SourceContract` inherits them all, so every
source's suite runs them: a source that claims a capability (has its members) must keep
its shapes, and one that does not is skipped for it. :class:`FaceContract` checks that
what :func:`mmcache.open_source` gives for the source is the source itself, so that what
the loader and ``ds[i]`` see claims exactly the capabilities the source claims (a wrapper
face once inherited ``lengths`` from ``FileSource`` over a Parquet source and failed with
an ``AttributeError``).

Each mixin reads ``self._source()`` and the sample count ``N`` of the suite.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mmcache.errors import ConfigError
from mmcache.sources.capabilities import (
    CAPABILITIES,
    FieldLayout,
    ForeseesReads,
    HasLengths,
    HasRejects,
    Revalidating,
)
from mmcache.sources.rejects import Reject

__all__ = [
    "FaceContract",
    "FieldLayoutContract",
    "ForeseesReadsContract",
    "HasLengthsContract",
    "HasRejectsContract",
    "RevalidatingContract",
]


def _source_of(suite: Any) -> Any:
    """The suite's source (``SourceContract._source``: ``N`` good samples)."""
    return suite._source()


def _claimed(suite: Any, capability: type) -> Any:
    source = _source_of(suite)
    if not isinstance(source, capability):
        pytest.skip(f"{type(source).__name__} does not claim {capability.__name__}")
    return source


class HasLengthsContract:
    """``lengths()``: ``int [N]``, every value >= 0; ``modalities()``: ``[N]``, bool-able.
    A :class:`~mmcache.errors.ConfigError` from ``lengths()`` (a file source without a chat
    stage) is a refusal, not a claim: the test is skipped, naming it."""

    def test_claimed_lengths_have_the_right_shape(self) -> None:
        source = _claimed(self, HasLengths)
        n = len(source)
        try:
            lengths = np.asarray(source.lengths())
        except ConfigError as err:  # offered only with some pipelines (FileSource: a chat stage)
            pytest.skip(f"{type(source).__name__} refuses lengths() here: {err}")
        assert lengths.shape == (n,) and np.issubdtype(lengths.dtype, np.integer)
        assert n == 0 or int(lengths.min()) >= 0
        flags = np.asarray(source.modalities())
        assert flags.shape == (n,) and flags.dtype in (np.bool_, np.int64, np.int32, np.uint8)


class FieldLayoutContract:
    """Three members, all present: sets of field names and an int pad id (or None); the
    fields named are fields of produced samples (or of the chat stage's output)."""

    def test_claimed_field_layout_is_whole_and_typed(self) -> None:
        source = _claimed(self, FieldLayout)
        for name in ("varying_fields", "channels_last_fields"):
            fields = getattr(source, name)
            assert all(isinstance(f, str) for f in fields), name
        pad = source.pad_token_id
        assert pad is None or isinstance(pad, int)
        sample = source.produce(0)
        assert set(source.channels_last_fields) <= set(sample)


class HasRejectsContract:
    """``rejects()``: a list of :class:`Reject`, empty for a fresh source of good samples."""

    def test_claimed_rejects_are_a_list_of_rejects(self) -> None:
        source = _claimed(self, HasRejects)
        listed = source.rejects()
        assert isinstance(listed, list) and all(isinstance(r, Reject) for r in listed)


class RevalidatingContract:
    """``revalidate()`` with nothing changed changes nothing: no URL and the same keys."""

    def test_claimed_revalidation_of_an_unchanged_source_is_a_no_op(self) -> None:
        source = _claimed(self, Revalidating)
        before = source.key_rows(list(range(len(source))))
        version = source.remote_version()
        assert source.revalidate() == []
        assert source.remote_version() == version
        np.testing.assert_array_equal(source.key_rows(list(range(len(source)))), before)


class ForeseesReadsContract:
    """Told a shuffled order (repeats included), the source produces each sample the same
    as without: foresight changes what is read, never what comes out."""

    def test_claimed_foresight_produces_the_same_samples(self) -> None:
        source = _claimed(self, ForeseesReads)
        n = len(source)
        order = np.random.default_rng(0).permutation(np.r_[np.arange(n), np.arange(n)[::2]])
        expected = {i: source.produce(i) for i in range(n)}
        source.foresee(order)
        for position, index in enumerate(order.tolist()):
            source.reached(position)
            got = source.produce(index)
            assert set(got) == set(expected[index])
            for name, value in got.items():
                np.testing.assert_array_equal(value, expected[index][name], err_msg=name)
        source.foresee(np.zeros(0, dtype=np.int64))


class FaceContract:
    """``open_source(source)`` is ``source``: it claims exactly the capabilities of
    ``source``."""

    def test_the_torch_face_claims_what_the_source_claims(self) -> None:
        from mmcache.dataset import open_source

        source = _source_of(self)
        face = open_source(source)
        assert face is source
        for capability in CAPABILITIES:
            assert isinstance(face, capability) == isinstance(source, capability), capability
        assert face.ids([0]) == source.ids([0]) and face.key(0) == source.key(0)
