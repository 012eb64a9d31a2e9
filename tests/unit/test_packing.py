"""pack=PackSpec(...): packs planned from the lengths only, no sample split, too-long samples
refused, cu_seqlens and position_ids consistent, one plan on every rank, resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mmcache import Cache, DataLoader, PackSpec, SampleError
from mmcache.errors import ConfigError
from mmcache.loader import Distributed, SFTBatching
from mmcache.loader.packing import first_fit_decreasing
from mmcache.testing.sft import SyntheticSFTSource


def _packs(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    loader.set_epoch(epoch)
    return list(loader)


def _ids(batch: dict[str, Any]) -> list[int]:
    return [int(s.split("-")[1]) for s in batch["id"]]


def test_packs_hold_whole_samples_with_consistent_cu_seqlens() -> None:
    src = SyntheticSFTSource(50, seed=1, max_text=120)
    lengths = src.lengths()
    loader = DataLoader(
        src, cache=None, batch_size=1, batching=SFTBatching(pack=PackSpec(max_tokens=256))
    )
    packs = _packs(loader, 0)
    assert sorted(i for p in packs for i in _ids(p)) == list(range(50))  # each once, whole
    for p in packs:
        ids = _ids(p)
        cu = p["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu[0] == 0
        assert torch.diff(cu).tolist() == lengths[ids].tolist()
        total = int(cu[-1])
        assert total <= 256 and p["input_ids"].shape == (1, total)
        assert p["labels"].shape == p["position_ids"].shape == (1, total)
        assert p["max_seqlen"] == int(lengths[ids].max())
        for j, i in enumerate(ids):
            a, b = int(cu[j]), int(cu[j + 1])
            sample = src.produce(i)
            assert p["input_ids"][0, a:b].tolist() == sample["input_ids"].tolist()
            assert p["position_ids"][0, a:b].tolist() == list(range(b - a))
            assert p["labels"][0, a] == -100  # nothing of this sample predicts its first token
            assert p["labels"][0, a + 1 : b].tolist() == sample["labels"][1:].tolist()
        assert p["image_counts"].tolist() == [len(src.produce(i)["image_sizes"]) for i in ids]
    # First-fit decreasing within one window fills packs well.
    fill = int(lengths.sum()) / (256 * len(packs))
    assert fill > 0.8


def test_first_fit_decreasing_never_overfills() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=300)
    packs = first_fit_decreasing(np.arange(300), lengths, 128)
    assert sorted(np.concatenate(packs).tolist()) == list(range(300))
    assert all(int(lengths[p].sum()) <= 128 for p in packs)
    assert len(packs) <= int(np.ceil(lengths.sum() / 128 * 1.25)) + 1


def test_a_sample_longer_than_max_tokens_is_an_error_naming_it() -> None:
    src = SyntheticSFTSource(20, seed=2, max_text=120)
    longest = int(np.argmax(src.lengths()))
    with pytest.raises(SampleError, match=src.sample_id(longest)):
        DataLoader(
            src, cache=None, batch_size=1, batching=SFTBatching(pack=PackSpec(max_tokens=100))
        )
    with pytest.raises(ConfigError, match="batch_size=1"):
        DataLoader(
            src, cache=None, batch_size=4, batching=SFTBatching(pack=PackSpec(max_tokens=4096))
        )
    with pytest.raises(ConfigError, match="max_tokens"):
        PackSpec(max_tokens=0)


def test_the_same_plan_on_every_rank_and_equal_pack_counts() -> None:
    src = SyntheticSFTSource(77, seed=3, max_text=90)
    spec = PackSpec(max_tokens=200, window=32)
    world = 4
    per_rank = []
    for rank in range(world):
        loader = DataLoader(
            src,
            cache=None,
            batch_size=1,
            seed=9,
            distributed=Distributed(rank=rank, world_size=world),
            batching=SFTBatching(pack=spec),
        )
        per_rank.append([_ids(p) for p in _packs(loader, 1)])
        assert len(loader) == len(per_rank[-1])
    assert len({len(p) for p in per_rank}) == 1
    # Interleaved back, the ranks' packs are one global plan: every sample, none split.
    global_plan = [p for step in zip(*per_rank, strict=True) for p in step]
    single = DataLoader(src, cache=None, batch_size=1, seed=9, batching=SFTBatching(pack=spec))
    alone = [_ids(p) for p in _packs(single, 1)]
    assert global_plan[: len(alone)] == alone
    assert global_plan[len(alone) :] == alone[: len(global_plan) - len(alone)]  # padded
    # Another epoch, another plan; the same epoch, the same plan.
    assert [_ids(p) for p in _packs(single, 2)] != alone
    assert [_ids(p) for p in _packs(single, 1)] == alone


def test_resume_mid_epoch_and_cold_equals_warm(cache_root: Path) -> None:
    src = SyntheticSFTSource(40, seed=4, max_text=60)
    spec = PackSpec(max_tokens=160)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        loader = DataLoader(src, cache=cache, batch_size=1, seed=2, batching=SFTBatching(pack=spec))
        cold = _packs(loader, 0)
        warm = _packs(loader, 0)
        assert loader.stats().epochs[-1].hits == 40
        for a, b in zip(cold, warm, strict=True):
            for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
                assert torch.equal(a[name], b[name])
        loader.set_epoch(0)
        it = iter(loader)
        head = [_ids(next(it)) for _ in range(2)]
        state = loader.state_dict()
        again = DataLoader(src, cache=cache, batch_size=1, seed=2, batching=SFTBatching(pack=spec))
        again.load_state_dict(state)
        again.set_epoch(0)
        assert head + [_ids(p) for p in again] == [_ids(p) for p in cold]
        other = DataLoader(
            src,
            cache=cache,
            batch_size=1,
            seed=2,
            batching=SFTBatching(pack=PackSpec(max_tokens=200)),
        )
        with pytest.raises(ConfigError, match="batching"):
            other.load_state_dict(state)


def test_packs_with_two_workers_equal_packs_without(cache_root: Path) -> None:
    src = SyntheticSFTSource(30, seed=5, max_text=50)
    spec = PackSpec(max_tokens=128)
    ref = _packs(DataLoader(src, cache=None, batch_size=1, batching=SFTBatching(pack=spec)), 0)
    with Cache(cache_root, memory="16MiB", temporary=True) as cache:
        packed = SFTBatching(pack=spec)
        loader = DataLoader(
            src, cache=cache, batch_size=1, num_workers=2, persistent_workers=True, batching=packed
        )
        got = _packs(loader, 0)  # misses produced by the workers
        warm = _packs(loader, 0)  # a guessed warm epoch, gathered here
        assert loader.stats().epochs[-1].hits == 30
        loader.close()
    for run in (got, warm):
        assert [_ids(p) for p in run] == [_ids(p) for p in ref]
        for a, b in zip(ref, run, strict=True):
            for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "image_counts"):
                assert torch.equal(a[name], b[name])


def test_samples_of_length_zero_are_left_out_of_grouped_and_packed_batches() -> None:
    # lengths() says 0 for a sample the source will refuse (fully masked, under skip).
    src = SyntheticSFTSource(20, seed=6, masked=(2, 11), on_error="skip")
    assert src.lengths()[[2, 11]].tolist() == [0, 0]
    packed = DataLoader(
        src, cache=None, batch_size=1, batching=SFTBatching(pack=PackSpec(max_tokens=128))
    )
    grouped = DataLoader(src, cache=None, batch_size=4, batching=SFTBatching(group_by_length=True))
    for loader in (packed, grouped):
        batches = _packs(loader, 0)
        assert len(batches) == len(loader)
        assert sorted(i for b in batches for i in _ids(b)) == sorted(set(range(20)) - {2, 11})
    assert src.rejects() == []  # never planned, so never even produced


class _WrongLengths(SyntheticSFTSource):
    def lengths(self) -> np.ndarray:
        out = super().lengths()
        out[5] -= 1  # one sample's count is off: a plan from it would not hold
        return out


def test_a_source_whose_lengths_lie_is_an_error_naming_the_sample() -> None:
    loader = DataLoader(
        _WrongLengths(12, seed=7),
        cache=None,
        batch_size=1,
        batching=SFTBatching(pack=PackSpec(256)),
    )
    with pytest.raises(ConfigError, match=r"sft-000005.*lengths\(\)"):
        list(loader)
