"""Elastic resume: a state saved mid-epoch under one world size resumes under another
with exactly the rest of the epoch, split in equal parts, then whole epochs as if never
interrupted (plain loaders with rank/world_size arguments, no processes)."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest

from mmcache.dataset import MultimodalDataset
from mmcache.errors import ConfigError
from mmcache.loader import DataLoader, Distributed
from mmcache.transforms.pipeline import Pipeline

BATCH = 2  # 40 samples, world 4: 5 batches of 2 per rank; 2 batches each = 16 = 40%


@pytest.fixture
def ds(tiny_data: Path, small_pipeline: Pipeline, tmp_path: Path) -> MultimodalDataset:
    recs = [json.loads(line) for line in tiny_data.read_text().splitlines()][:40]
    for r in recs:
        r["image_path"] = str(tiny_data.parent / r["image_path"])
    path = tmp_path / "forty.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return MultimodalDataset(path, pipeline=small_pipeline)


def _loaders(ds: MultimodalDataset, world: int, **kw: Any) -> list[DataLoader]:
    return [
        DataLoader(
            ds,
            cache=None,
            batch_size=BATCH,
            seed=5,
            **kw,
            distributed=Distributed(rank=r, world_size=world),
        )
        for r in range(world)
    ]


def _ids(loader: DataLoader, epoch: int, stop: int | None = None) -> list[list[str]]:
    loader.set_epoch(epoch)
    out = []
    for k, batch in enumerate(loader):
        out.append(list(batch["id"]))
        if stop is not None and k + 1 == stop:
            break
    return out


def _whole_epoch(ds: MultimodalDataset, epoch: int) -> list[str]:
    (alone,) = _loaders(ds, 1)
    return [i for b in _ids(alone, epoch) for i in b]


def _stop_world_4(ds: MultimodalDataset, batches: int) -> tuple[list[str], dict[str, Any]]:
    """Four ranks each take ``batches`` batches of epoch 1; what they saw and the state."""
    seen: list[str] = []
    states = []
    for loader in _loaders(ds, 4):
        seen += [i for b in _ids(loader, 1, stop=batches) for i in b]
        states.append(json.loads(json.dumps(loader.state_dict())))
    assert len({s["consumed"] for s in states}) == 1  # the same global position on every rank
    return seen, states[0]


@pytest.mark.parametrize("world", [2, 1, 3])
def test_stop_at_40_percent_with_world_4_resume_with_another_world_gives_exactly_the_rest(
    ds: MultimodalDataset, world: int
) -> None:
    seen, state = _stop_world_4(ds, 2)
    assert state["consumed"] == 16
    whole = _whole_epoch(ds, 1)
    rest = whole[16:]
    after: list[list[str]] = []
    for loader in _loaders(ds, world):
        loader.load_state_dict(state)
        after.append([i for b in _ids(loader, 1) for i in b])
    lengths = {len(a) for a in after}
    assert len(lengths) == 1  # equal parts: no rank waits for another at the end
    got = [i for a in after for i in a]
    assert set(got) == set(rest) and set(seen) | set(got) == set(whole)
    assert not set(seen) & set(got)  # nothing repeated from before the stop
    extra = len(got) - len(rest)
    assert 0 <= extra < world  # padded by repeating the rest's first samples
    assert collections.Counter(got) - collections.Counter(rest) == collections.Counter(rest[:extra])
    # Then the next epoch is the uninterrupted run's under the new world size.
    for r, loader in enumerate(_loaders(ds, world)):
        loader.load_state_dict(state)
        _ids(loader, 1)
        want = _ids(_loaders(ds, world)[r], 2)
        assert _ids(loader, 2) == want


def test_drop_last_cuts_the_rest_to_equal_parts(ds: MultimodalDataset) -> None:
    loaders = [
        DataLoader(
            ds,
            cache=None,
            batch_size=BATCH,
            seed=5,
            distributed=Distributed(rank=r, world_size=4, drop_last=True),
        )
        for r in range(4)
    ]
    _ids(loaders[0], 1, stop=2)
    state = loaders[0].state_dict()
    after = []
    for r in range(5):
        loader = DataLoader(
            ds,
            cache=None,
            batch_size=BATCH,
            seed=5,
            distributed=Distributed(rank=r, world_size=5, drop_last=True),
        )
        loader.load_state_dict(state)
        after.append([i for b in _ids(loader, 1) for i in b])
    assert [len(a) for a in after] == [4] * 5  # 24 left: 20 read, the last 4 dropped
    (alone,) = _loaders(ds, 1)
    whole = [i for b in _ids(alone, 1) for i in b]
    assert sorted(i for a in after for i in a) == sorted(whole[16:36])


def test_a_resumed_run_saved_again_resumes_under_a_third_world_size(
    ds: MultimodalDataset,
) -> None:
    # world 4 -> 2 after 16 samples, 2 batches more there (8 samples, 60%), then world 1.
    seen, state = _stop_world_4(ds, 2)
    mid = []
    for loader in _loaders(ds, 2):
        loader.load_state_dict(state)
        mid += [i for b in _ids(loader, 1, stop=2) for i in b]
    second = loader.state_dict()
    assert second["consumed"] == 24 and second["span"] == [16, 40]
    (alone,) = _loaders(ds, 1)
    alone.load_state_dict(second)
    last = [i for b in _ids(alone, 1) for i in b]
    whole = _whole_epoch(ds, 1)
    assert sorted(seen + mid + last) == sorted(whole)
    assert last == whole[24:]


def test_same_world_size_resumes_the_same_batches_and_old_versions_still_load(
    ds: MultimodalDataset,
) -> None:
    ref = _ids(_loaders(ds, 2)[1], 1)
    loader = _loaders(ds, 2)[0]
    _ids(loader, 1, stop=2)
    state = loader.state_dict()  # rank 0's state, loaded on rank 1: same position
    other = _loaders(ds, 2)[1]
    other.load_state_dict(state)
    assert _ids(other, 1) == ref[2:]
    old = {k: v for k, v in state.items() if k not in ("consumed", "stop", "span")}
    old["version"] = 2
    with pytest.raises(ConfigError, match="rank"):
        other.load_state_dict(old)  # version 2: same rank and world size only
    old["rank"] = 1
    other.load_state_dict(old)
    assert _ids(other, 1) == ref[2:]
    with pytest.raises(ConfigError, match="version 9"):
        other.load_state_dict({**state, "version": 9})
