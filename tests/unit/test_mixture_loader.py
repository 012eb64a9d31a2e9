"""A ``Mixture`` through the ``DataLoader``: bitwise the same batches cached or not, cold
or warm, with workers; every row naming its part; counts per part; exact resume at every
batch under other worker counts and world sizes; a state of another mixture refused;
SFT parts of different modalities grouped and packed; the admitted entries' cost weighed
by how often their part comes back."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import mmcache as mc
from mmcache.errors import ConfigError
from mmcache.loader import DataLoader, Distributed, PackSpec, SFTBatching
from mmcache.synth import make_dataset
from mmcache.testing.sft import SyntheticSFTSource
from mmcache.transforms.pipeline import Pipeline

Pairs = list[tuple[str, str]]


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("mixture-data")
    return make_dataset(out / "coco", 12, seed=1), make_dataset(out / "vqa", 10, seed=2)


@pytest.fixture
def mix(manifests: tuple[Path, Path], small_pipeline: Pipeline) -> mc.Mixture:
    a, b = (mc.MultimodalDataset(m, pipeline=small_pipeline) for m in manifests)
    return mc.Mixture(
        [mc.MixturePart(a, name="coco", repeat=2), mc.MixturePart(b, name="vqa", repeat=0.5)]
    )


def _sft_mix(**kw: Any) -> mc.Mixture:
    """Image, multi-image and text-only SFT parts under one layout."""
    return mc.Mixture(
        [
            mc.MixturePart(
                SyntheticSFTSource(9, seed=1, image_counts=(1,)), name="img", repeat=1.5
            ),
            mc.MixturePart(SyntheticSFTSource(7, seed=2, image_counts=(2, 3)), name="multi"),
            mc.MixturePart(SyntheticSFTSource(8, seed=3, image_counts=(0,)), name="text", choose=5),
        ],
        **kw,
    )


def _pairs(batches: list[dict[str, Any]]) -> Pairs:
    return [(p, i) for b in batches for p, i in zip(b["part"], b["id"], strict=True)]


def _epoch(loader: DataLoader, epoch: int, stop: int | None = None) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    out = []
    for k, batch in enumerate(loader):
        out.append(batch)
        if stop is not None and k + 1 == stop:
            break
    return out


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"] and x["part"] == y["part"]
        for name in x:
            if isinstance(x[name], torch.Tensor):
                assert torch.equal(x[name], y[name]), name


def test_cached_batches_are_the_uncached_ones_cold_and_warm_with_workers(
    mix: mc.Mixture, cache_root: Path
) -> None:
    plain = DataLoader(mix, cache=None, batch_size=5, seed=3)
    want = [_epoch(plain, e) for e in range(3)]
    with mc.Cache(cache_root, memory="32MiB", temporary=True) as cache:
        loader = DataLoader(mix, cache=cache, batch_size=5, seed=3, num_workers=2)
        got = [_epoch(loader, e) for e in range(3)]
        stats = loader.stats()
        loader.close()
    for w, g in zip(want, got, strict=True):
        _same(w, g)
    assert stats.epochs[0].misses == mix.unique_samples - 10 + 5  # vqa: 5 of its 10
    assert stats.epochs[1].parts["coco"].misses == 0  # warm: coco was all there
    assert stats.epochs[1].parts["vqa"].misses == 5  # the other half of vqa, first seen
    assert stats.epochs[2].hit_rate == 1.0
    # every epoch: 24 coco rows (each sample twice) and 5 vqa rows
    for e, epoch_stats in enumerate(stats.epochs):
        assert {n: p.samples for n, p in epoch_stats.parts.items()} == {"coco": 24, "vqa": 5}
        assert sum(p.hits for p in epoch_stats.parts.values()) == epoch_stats.hits
        counts = collections.Counter(p for p, _ in _pairs(got[e]))
        assert counts == {"coco": 24, "vqa": 5}
    assert stats.parts["vqa"].samples == 15 and stats.as_dict()["parts"]["coco"]["samples"] == 72


def test_every_row_names_its_part(mix: mc.Mixture) -> None:
    loader = DataLoader(mix, cache=None, batch_size=4, seed=0)
    coco = set(mix.parts[0].source.ids(range(12)))
    for batch in _epoch(loader, 0):
        assert len(batch["part"]) == len(batch["id"]) == len(batch["image"])
        for part, sid in zip(batch["part"], batch["id"], strict=True):
            assert part in ("coco", "vqa")
            assert part != "coco" or sid in coco


def test_set_epoch_replays_an_epoch(mix: mc.Mixture) -> None:
    loader = DataLoader(mix, cache=None, batch_size=5, seed=1)
    first = _pairs(_epoch(loader, 1))
    _epoch(loader, 2)
    assert _pairs(_epoch(loader, 1)) == first
    assert _pairs(_epoch(loader, 1)) != _pairs(_epoch(loader, 2))


@pytest.mark.parametrize(("save_workers", "resume_workers"), [(0, 2), (2, 0)])
def test_resume_at_every_batch_gives_the_uninterrupted_run(
    save_workers: int, resume_workers: int
) -> None:
    mix = _sft_mix()
    kw: dict[str, Any] = {"cache": None, "batch_size": 4, "seed": 7}
    reference = DataLoader(mix, **kw)
    want = [_pairs(_epoch(reference, e)) for e in (1, 2)]
    batches = len(reference)
    for stop in range(batches + 1):
        first = DataLoader(mix, num_workers=save_workers, **kw)
        first.set_epoch(1)
        before = _pairs(_epoch(first, 1, stop=stop)) if stop else []
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        resumed = DataLoader(mix, num_workers=resume_workers, **kw)
        resumed.load_state_dict(state)
        resumed.set_epoch(1)
        after = _pairs(list(resumed))
        assert before + after == want[0], stop
        assert _pairs(_epoch(resumed, 2)) == want[1]
        resumed.close()


@pytest.mark.parametrize("world", [1, 3])
def test_resume_at_every_batch_under_another_world_size(world: int) -> None:
    mix = _sft_mix()

    def loaders(n: int) -> list[DataLoader]:
        return [
            DataLoader(
                mix, cache=None, batch_size=2, seed=4, distributed=Distributed(rank=r, world_size=n)
            )
            for r in range(n)
        ]

    (alone,) = loaders(1)
    whole = _pairs(_epoch(alone, 1))
    assert len(whole) == len(mix)
    per_rank = len(loaders(2)[0])
    for stop in range(1, per_rank + 1):
        seen: Pairs = []
        states = []
        for loader in loaders(2):
            seen += _pairs(_epoch(loader, 1, stop=stop))
            states.append(json.loads(json.dumps(loader.state_dict())))
        consumed = states[0]["consumed"]
        rest = whole[consumed:]
        got: Pairs = []
        for loader in loaders(world):
            loader.load_state_dict(states[0])
            loader.set_epoch(1)
            got += _pairs(list(loader))
        extra = len(got) - len(rest)
        assert 0 <= extra < world
        assert collections.Counter(got) - collections.Counter(rest) == collections.Counter(
            rest[:extra]
        )
        assert collections.Counter(seen) + collections.Counter(rest) == collections.Counter(
            whole
        ) or consumed == len(whole)


def test_a_state_of_another_mixture_is_refused_naming_the_change() -> None:
    mix = _sft_mix()
    loader = DataLoader(mix, cache=None, batch_size=4, seed=7)
    _epoch(loader, 0, stop=1)
    state = loader.state_dict()
    assert state["mixture"][0] == ["img", 9, "repeat=1.5", 14]
    parts = list(mix.parts)
    changed = mc.Mixture(
        [parts[0], parts[1], mc.MixturePart(parts[2].source, name="text", choose=6)]
    )
    with pytest.raises(
        ConfigError,
        match=r"another mixture \(part 2: option 'choose=5' -> "
        r"'choose=6', count 5 -> 6\)",
    ):
        DataLoader(changed, cache=None, batch_size=4, seed=7).load_state_dict(state)
    with pytest.raises(ConfigError, match="a mixture of 3 parts, this loader's has 2"):
        DataLoader(mc.Mixture(parts[:2]), cache=None, batch_size=4, seed=7).load_state_dict(state)
    one = SyntheticSFTSource(9, seed=1, image_counts=(1,))
    with pytest.raises(ConfigError, match="saved by a loader over a Mixture"):
        DataLoader(one, cache=None, batch_size=4, seed=7).load_state_dict(state)
    plain_state = DataLoader(one, cache=None, batch_size=4, seed=7).state_dict()
    with pytest.raises(ConfigError, match="this loader reads a Mixture"):
        loader.load_state_dict(plain_state)


@pytest.mark.parametrize(
    "batching",
    [SFTBatching(), SFTBatching(group_by_length=True), SFTBatching(pack=PackSpec(64))],
    ids=["padded", "grouped", "packed"],
)
def test_parts_of_other_modalities_are_padded_grouped_and_packed_together(
    batching: SFTBatching, cache_root: Path
) -> None:
    mix = _sft_mix()
    kw: dict[str, Any] = {"batch_size": 1 if batching.pack else 4, "seed": 2, "batching": batching}
    want = [_epoch(DataLoader(mix, cache=None, **kw), e) for e in range(2)]
    with mc.Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(mix, cache=cache, num_workers=2, **kw)
        got = [_epoch(loader, e) for e in range(2)]
        loader.close()
    for w, g in zip(want, got, strict=True):
        _same(w, g)
    rows = collections.Counter(p for p, _ in _pairs(got[0]))
    assert rows == mix.counts
    if batching.group_by_length:  # one modality per batch: text-only rows apart
        for batch in got[0]:
            assert len({p == "text" for p in batch["part"]}) == 1


def test_grouping_a_part_without_lengths_names_it(mix: mc.Mixture) -> None:
    with pytest.raises(ConfigError, match=r"mixture part 'coco': lengths\(\), .* need a pipeline"):
        DataLoader(mix, cache=None, batch_size=4, batching=SFTBatching(group_by_length=True))


def test_an_admitted_entry_costs_its_miss_times_its_part_reads_per_epoch(
    mix: mc.Mixture, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The planned order reaches the policy: a coco sample (read twice an epoch) is
    admitted with twice its miss cost, a vqa one (half the epochs) with half."""
    from mmcache import readthrough  # times every produce (the loader's workers' too)

    clock = iter(range(0, 10**6, 3))  # every produce takes exactly 3 "CPU seconds"
    monkeypatch.setattr(readthrough.time, "thread_time", lambda: float(next(clock)))
    with mc.Cache(cache_root, memory="32MiB", temporary=True) as cache:
        loader = DataLoader(mix, cache=cache, batch_size=5, seed=3, num_workers=0)
        _epoch(loader, 0)
        memory = cache.tiers["memory"]
        costs = {
            part: {
                memory.info(mix.key(i)).cost
                for i in range(mix.unique_samples)
                if mix.part_names[int(mix.part_of([i])[0])] == part
                and memory.info(mix.key(i)) is not None
            }
            for part in mix.part_names
        }
        loader.close()
    assert costs == {"coco": {6.0}, "vqa": {1.5}}
    assert np.isclose(mix.planned_reads(0), 2.0)


def test_a_part_walking_through_its_samples_raises_no_low_hit_rate_warning(
    manifests: tuple[Path, Path],
    small_pipeline: Pipeline,
    cache_root: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Epoch 1 of ``choose=2`` of 12 reads two samples epoch 0 did not: misses of the
    draw, not of the cache, so the warning that blames the cache stays quiet."""
    a, b = (mc.MultimodalDataset(m, pipeline=small_pipeline) for m in manifests)
    walk = mc.Mixture(
        [mc.MixturePart(a, name="a", choose=2), mc.MixturePart(b, name="b", choose=1)]
    )
    with mc.Cache(cache_root, memory="32MiB", temporary=True) as cache:
        loader = DataLoader(walk, cache=cache, batch_size=3, seed=0)
        with caplog.at_level("WARNING", logger="mmcache"):
            _epoch(loader, 0)
            _epoch(loader, 1)
        loader.close()
    assert loader.stats().epochs[1].hit_rate == 0.0  # every sample of epoch 1 is new
    assert "far below" not in caplog.text


def test_parts_of_any_source_a_loader_takes(
    manifests: tuple[Path, Path], small_pipeline: Pipeline, tmp_path: Path, cache_root: Path
) -> None:
    """Loose files (stat-stamped), a Parquet folder and a saved HF dataset (fixed stamps)
    in one mixture: cached batches equal the uncached ones over three epochs."""
    pytest.importorskip("datasets")
    from mmcache.testing.tabular import write_hf_dataset, write_parquet

    write_parquet(manifests[1], tmp_path / "pq", files=2, row_group_size=4)
    write_hf_dataset(manifests[1], tmp_path / "hf")
    loose = mc.MultimodalDataset(manifests[0], pipeline=small_pipeline)
    parquet = mc.open_source(tmp_path / "pq", pipeline=small_pipeline)
    hf = mc.open_source(tmp_path / "hf", pipeline=small_pipeline)
    mix = mc.Mixture(
        [
            mc.MixturePart(loose, name="loose", repeat=0.5),
            mc.MixturePart(parquet, name="parquet", choose=4),
            mc.MixturePart(hf, name="hf", repeat=2),
        ]
    )
    assert mix.stamp_kind.value == "file"
    want = [_epoch(DataLoader(mix, cache=None, batch_size=5, seed=1), e) for e in range(3)]
    with mc.Cache(cache_root, memory="32MiB", temporary=True) as cache:
        loader = DataLoader(mix, cache=cache, batch_size=5, seed=1, num_workers=2)
        got = [_epoch(loader, e) for e in range(3)]
        loader.close()
    for w, g in zip(want, got, strict=True):
        _same(w, g)
    assert collections.Counter(p for p, _ in _pairs(got[2])) == mix.counts
