"""Resuming a DataLoader with the documented loop yields the batches of an uninterrupted run.

The loop of the README: ``for e in range(start, N): loader.set_epoch(e); for
batch in loader: ...``, saving ``(e, loader.state_dict())`` after a batch. The
order of epoch ``e`` is a pure function of (seed, e): ``set_epoch(e)`` yields
epoch ``e`` (after ``load_state_dict``: what remains of it, maybe nothing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mmcache.cache import Cache
from mmcache.dataset import MultimodalDataset
from mmcache.errors import ConfigError
from mmcache.loader import DataLoader
from mmcache.transforms.pipeline import Pipeline

EPOCHS = 3
BATCH = 10  # 48 samples: 5 batches per epoch, the last of 8

Seen = list[tuple[int, list[str]]]


@pytest.fixture
def ds(tiny_data: Path, small_pipeline: Pipeline) -> MultimodalDataset:
    return MultimodalDataset(tiny_data, pipeline=small_pipeline)


def _train(
    loader: DataLoader, start: int = 0, save_after: tuple[int, int] | None = None
) -> tuple[Seen, Any]:
    """The documented loop from epoch ``start``; stops after batch k of epoch e when
    ``save_after=(e, k)``, returning what it saw and the checkpoint (a JSON round trip)."""
    seen: Seen = []
    for epoch in range(start, EPOCHS):
        loader.set_epoch(epoch)
        for k, batch in enumerate(loader):
            seen.append((epoch, batch["id"]))
            if save_after == (epoch, k):
                return seen, json.loads(json.dumps([epoch, loader.state_dict()]))
    return seen, None


def _reference(ds: MultimodalDataset) -> Seen:
    seen, _ = _train(DataLoader(ds, cache=None, batch_size=BATCH, seed=3))
    assert len(seen) == 15
    return seen


@pytest.mark.parametrize("resume_workers", [0, 2])
@pytest.mark.parametrize("save_after", [(1, 0), (1, 2), (1, 4), (2, 4)])
def test_resume_yields_exactly_the_batches_of_an_uninterrupted_run(
    ds: MultimodalDataset, cache_root: Path, save_after: tuple[int, int], resume_workers: int
) -> None:
    want = _reference(ds)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        first = DataLoader(
            ds, cache=cache, batch_size=BATCH, seed=3, num_workers=2 - resume_workers
        )
        before, (epoch, state) = _train(first, 0, save_after)
        first.close()
        resumed = DataLoader(ds, cache=cache, batch_size=BATCH, seed=3, num_workers=resume_workers)
        resumed.load_state_dict(state)
        after, _ = _train(resumed, epoch)
        resumed.close()
    assert before + after == want  # same batches, same epoch labels, nothing extra


@pytest.mark.parametrize("workers", [0, 2])
def test_set_epoch_replays_an_epoch_already_iterated(
    ds: MultimodalDataset, cache_root: Path, workers: int
) -> None:
    want = [ids for _, ids in _reference(ds)]
    cache = Cache(cache_root, memory="16MiB", temporary=True)
    loader = DataLoader(
        ds, cache=cache, batch_size=BATCH, seed=3, num_workers=workers,
        persistent_workers=workers > 0,
    )  # fmt: skip
    loader.set_epoch(0)
    assert [b["id"] for b in loader] == want[:5]
    loader.set_epoch(0)  # again: epoch 0, not epoch 1
    assert [b["id"] for b in loader] == want[:5]
    assert loader.epoch == 0
    assert [b["id"] for b in loader] == want[5:10]  # no set_epoch: the next epoch
    assert loader.epoch == 1
    it = iter(loader)  # epoch 1 finished: on to epoch 2, left after one batch
    assert next(it)["id"] == want[10]
    del it
    loader.set_epoch(2)  # chosen again: the whole epoch
    assert [b["id"] for b in loader] == want[10:]
    loader.set_epoch(1)  # back in time
    assert [b["id"] for b in loader] == want[5:10]
    loader.close()
    cache.close()


def test_a_version_1_state_still_resumes(ds: MultimodalDataset) -> None:
    loader = DataLoader(ds, cache=None, batch_size=BATCH, seed=3)
    state = loader.state_dict()
    state["version"], state["position"] = 1, 3
    del state["ids"]  # what mmcache saved before the ids digest
    loader.load_state_dict(state)
    loader.set_epoch(0)
    assert len(list(loader)) == 2


def test_a_state_saved_at_the_end_of_an_epoch_resumes_in_the_next_one_without_set_epoch(
    ds: MultimodalDataset,
) -> None:
    # A loop that never calls set_epoch (one epoch per `for`) goes on with the next epoch.
    want = [ids for _, ids in _reference(ds)]
    loader = DataLoader(ds, cache=None, batch_size=BATCH, seed=3)
    list(loader)
    resumed = DataLoader(ds, cache=None, batch_size=BATCH, seed=3)
    resumed.load_state_dict(loader.state_dict())
    assert [b["id"] for b in resumed] == want[5:10]


def _reversed_manifest(tmp_path: Path, tiny_data: Path) -> Path:
    recs = [json.loads(line) for line in tiny_data.read_text().splitlines()]
    for r in recs:
        r["image_path"] = str(tiny_data.parent / r["image_path"])
    path = tmp_path / "reversed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reversed(recs)))
    return path


def test_resume_refuses_a_reordered_manifest_of_the_same_length(
    ds: MultimodalDataset, tmp_path: Path, tiny_data: Path, small_pipeline: Pipeline
) -> None:
    loader = DataLoader(ds, cache=None, batch_size=BATCH, seed=3)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    del it
    other = MultimodalDataset(_reversed_manifest(tmp_path, tiny_data), pipeline=small_pipeline)
    assert len(other) == len(ds)
    with pytest.raises(ConfigError, match="ids"):
        DataLoader(other, cache=None, batch_size=BATCH, seed=3).load_state_dict(state)
    # the same manifest read again resumes
    DataLoader(
        MultimodalDataset(ds.records.source, pipeline=small_pipeline),
        cache=None,
        batch_size=BATCH,
        seed=3,
    ).load_state_dict(state)


@pytest.mark.parametrize(
    ("change", "name"),
    [
        ({"position": -3}, "position"),
        ({"position": 6}, "position"),  # 5 batches per epoch
        ({"position": 2.5}, "position"),
        ({"position": True}, "position"),
        ({"epoch": -1}, "epoch"),
        ({"epoch": "1"}, "epoch"),
        ({"seed": None}, "seed"),  # removed
        ({"position": None}, "position"),
        ({"ids": None}, "ids"),
        # The global position (version 3): checked though a same-world-size resume
        # goes by position, as another world size's resume would read it.
        ({"consumed": 4.0}, "consumed"),
        ({"consumed": 49}, "consumed"),  # past stop (48)
        ({"stop": True}, "stop"),
        ({"stop": 49}, "stop"),  # past the dataset's 48 samples
        ({"span": [3, 1]}, "span"),
        ({"span": [0, "a"]}, "span"),
        ({"span": [0, 40]}, "span"),  # its end is not the state's stop
        ({"span": [0, 1, 48]}, "span"),
        ({"span": "0-48"}, "span"),
        ({"span": [8, 48]}, "consumed"),  # consumed 0 lies before the span's start
        ({"span": None}, "span"),  # removed
        ({"world_size": 2.0}, "world_size"),
        ({"rank": 1}, "rank"),  # world_size 1
    ],
)
def test_resume_refuses_a_bad_state_naming_the_key(
    ds: MultimodalDataset, change: dict[str, Any], name: str
) -> None:
    loader = DataLoader(ds, cache=None, batch_size=BATCH, seed=3)
    state = loader.state_dict()
    for key, value in change.items():
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value
    with pytest.raises(ConfigError, match=name) as err:
        loader.load_state_dict(state)
    assert not isinstance(err.value, KeyError)
    assert loader.state_dict()["position"] == 0  # nothing restored


@pytest.mark.parametrize("name", ["ids", "seed", "epoch", "span", "batching", "version"])
def test_resume_errors_show_a_tampered_value_cut_short(ds: MultimodalDataset, name: str) -> None:
    # A state file edited or damaged into megabytes: the error names the key and
    # shows the start of the value, not all of it.
    loader = DataLoader(ds, cache=None, batch_size=BATCH, seed=3)
    state = {**loader.state_dict(), name: "7" * 1_000_000}
    with pytest.raises(ConfigError, match=name) as err:
        loader.load_state_dict(state)
    assert len(str(err.value)) < 600, str(err.value)[:600]
    assert "1000002 characters" in str(err.value)


def test_resume_refuses_an_int_too_long_to_print(ds: MultimodalDataset) -> None:
    loader = DataLoader(ds, cache=None, batch_size=BATCH, seed=3)
    with pytest.raises(ConfigError, match=r"position .* got <an int of"):
        loader.load_state_dict({**loader.state_dict(), "position": 10**5000})


def test_resume_accepts_the_end_of_an_epoch(ds: MultimodalDataset) -> None:
    loader = DataLoader(ds, cache=None, batch_size=BATCH, seed=3)
    state = loader.state_dict()
    state["position"] = 5
    loader.load_state_dict(state)
    loader.set_epoch(0)
    assert list(loader) == []  # what remains of epoch 0: nothing


def test_ids_digest_tells_orders_and_id_boundaries_apart(tmp_path: Path) -> None:
    from mmcache.sources.readers import read_manifest

    def digest(ids: list[str]) -> str:
        path = tmp_path / "m.jsonl"
        rows = [{"id": i, "image_path": f"{n}.jpg", "caption": "c"} for n, i in enumerate(ids)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return read_manifest(path).ids_digest()

    base = digest(["ab", "c", "d"])
    assert digest(["ab", "c", "d"]) == base
    assert digest(["c", "ab", "d"]) != base  # reordered
    assert digest(["a", "bc", "d"]) != base  # same bytes, other ids
