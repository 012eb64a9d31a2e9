"""The core asks a source for its capabilities by ``isinstance``, and names the one it lacks.

Once, ``MultimodalDataset("x.parquet")`` was a wrapper face (``SourceDataset``) that
inherited ``FileSource.lengths`` without its state, so ``group_by_length=True`` failed with
an ``AttributeError`` about ``_chat`` instead of saying what the source lacks. Now every
source is its own torch ``Dataset`` and :func:`mmcache.open_source` gives it itself.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

import mmcache as mc
from mmcache.errors import ConfigError
from mmcache.loader import DataLoader, SFTBatching
from mmcache.sources.blobs.prefetch import RemotePrefetch
from mmcache.sources.capabilities import (
    FieldLayout,
    HasLengths,
    HasRejects,
    Revalidating,
    layout_of,
    members_of,
)
from mmcache.sources.parquet import ParquetSource
from mmcache.synth import make_dataset
from mmcache.testing.sft import SyntheticSFTSource
from mmcache.testing.tabular import write_parquet
from mmcache.transforms.pipeline import Pipeline


@pytest.fixture
def parquet(tmp_path: Path) -> Path:
    return write_parquet(make_dataset(tmp_path / "loose", 6, seed=2), tmp_path / "pq")[0]


def test_group_by_length_on_a_source_without_lengths_names_the_capability(
    parquet: Path, small_pipeline: Pipeline
) -> None:
    ds = mc.open_source(parquet, pipeline=small_pipeline)
    assert isinstance(ds, ParquetSource)
    assert not isinstance(ds, HasLengths)
    with pytest.raises(ConfigError, match=r"group_by_length=True.*HasLengths.*lengths"):
        DataLoader(ds, cache=None, batch_size=2, batching=SFTBatching(group_by_length=True))


def test_the_face_claims_a_capability_exactly_when_its_source_does(
    parquet: Path, small_pipeline: Pipeline
) -> None:
    ds = mc.open_source(parquet, pipeline=small_pipeline)
    assert isinstance(ds, ParquetSource)
    assert isinstance(ds, FieldLayout) and isinstance(ds, HasRejects)
    assert not isinstance(ds, Revalidating)
    assert layout_of(ds).varying == ds.varying_fields
    assert ds.pad_token_id is None
    own = SyntheticSFTSource(8, seed=1)
    sft = mc.open_source(own)
    assert sft is own and isinstance(sft, HasLengths)
    assert np.array_equal(sft.lengths(), own.lengths())
    again = pickle.loads(pickle.dumps(ds))
    assert again.ids([0, 1]) == ds.ids([0, 1]) and not hasattr(again, "lengths")


def test_remote_prefetch_of_a_local_source_says_what_to_do_in_user_terms(
    parquet: Path, small_pipeline: Pipeline
) -> None:
    # Item 12 of issue 37: the message listed the capability's member names
    # ("needs a source with Revalidating (fetch, raw, remote, ...)"); it says what to do.
    ds = mc.open_source(parquet, pipeline=small_pipeline)
    with pytest.raises(ConfigError, match=r"RemotePrefetch cannot drive .*ParquetSource") as info:
        RemotePrefetch(ds)
    message = str(info.value)
    assert "leave it out of hooks=" in message and "s3://" in message
    for internal in ("Revalidating", "remote_span", "remote_version", "fetch,", "raw,"):
        assert internal not in message, internal


class _HalfLayout(SyntheticSFTSource):
    """A layout without ``channels_last_fields``: half read, its batches would be wrong."""

    def __getattribute__(self, name: str) -> object:
        if name == "channels_last_fields":
            raise AttributeError(name)
        return super().__getattribute__(name)


def test_half_a_field_layout_is_refused_naming_the_missing_member() -> None:
    assert members_of(FieldLayout) == ["channels_last_fields", "pad_token_id", "varying_fields"]
    with pytest.raises(ConfigError, match=r"FieldLayout.*has no channels_last_fields"):
        DataLoader(_HalfLayout(8, seed=1), cache=None, batch_size=2)


def test_open_source_refuses_what_a_manifest_does_not_take(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    manifest = make_dataset(tmp_path / "loose", 3, seed=3)
    ds = mc.open_source(manifest, pipeline=small_pipeline)
    assert type(ds) is mc.MultimodalDataset and len(ds) == 3
    with pytest.raises(ConfigError, match="columns="):
        mc.open_source(manifest, pipeline=small_pipeline, columns={"id": "id"})
    with pytest.raises(ConfigError, match="content_stamp"):
        mc.open_source(write_parquet(manifest, tmp_path / "pq")[0], content_stamp=True)
