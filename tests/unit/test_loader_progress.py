"""DataLoader(progress=True): a tqdm bar per epoch with samples/s and the hit rate by tier."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import mmcache as mc
from mmcache.loader.progress import epoch_postfix
from mmcache.stats import EpochStats


def _bars(err: str) -> list[str]:
    """The final state of each epoch's bar (tqdm rewrites its line with carriage returns)."""
    lines = (line.split("\r")[-1] for line in err.split("\n"))
    return [line for line in lines if line.startswith("epoch ")]


def test_a_bar_per_epoch_shows_samples_per_second_and_each_tiers_share(
    tiny_data: Path, small_pipeline, cache_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = mc.MultimodalDataset(tiny_data, pipeline=small_pipeline)
    with mc.Cache(cache_root, memory="64MiB", disk="64MiB") as cache:
        loader = mc.DataLoader(ds, cache=cache, batch_size=16, progress=True)
        seen = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            seen.append(sum(len(b["id"]) for b in loader))
        loader.close()
    assert seen == [48, 48]  # the bar changes nothing in the batches
    bars = _bars(capsys.readouterr().err)
    assert len(bars) == 2, bars
    cold, warm = bars
    assert cold.startswith("epoch 0") and "3/3" in cold and "samples/s" in cold
    assert "miss 100%" in cold and "memory 0%" in cold
    assert warm.startswith("epoch 1") and "3/3" in warm
    assert "memory 100%" in warm and "miss 0%" in warm
    assert re.search(r"[\d,]+ samples/s", warm)


def test_without_progress_nothing_is_printed(
    tiny_data: Path, small_pipeline, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = mc.MultimodalDataset(tiny_data, pipeline=small_pipeline)
    loader = mc.DataLoader(ds, cache=None, batch_size=16)
    assert sum(len(b["id"]) for b in loader) == 48
    loader.close()
    assert "epoch" not in capsys.readouterr().err


def test_a_break_closes_the_bar_and_the_next_epoch_starts_clean(
    tiny_data: Path, small_pipeline, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = mc.MultimodalDataset(tiny_data, pipeline=small_pipeline)
    loader = mc.DataLoader(ds, cache=None, batch_size=16, progress=True)
    for _batch in loader:
        break
    loader.set_epoch(1)
    assert sum(len(b["id"]) for b in loader) == 48
    loader.close()
    bars = _bars(capsys.readouterr().err)
    assert [b.split(":")[0] for b in bars] == ["epoch 0", "epoch 1"]
    assert "1/3" in bars[0] and "3/3" in bars[1]


def test_progress_must_be_a_bool(tiny_data: Path, small_pipeline) -> None:
    ds = mc.MultimodalDataset(tiny_data, pipeline=small_pipeline)
    with pytest.raises(mc.ConfigError, match="progress must be True or False, got 'yes'"):
        mc.DataLoader(ds, cache=None, batch_size=16, progress="yes")  # type: ignore[arg-type]


def test_the_postfix_names_every_tier_and_the_misses() -> None:
    stats = EpochStats(
        epoch=2, samples=100, hits=75, misses=25, seconds=0.5, tier_hits={"memory": 50, "disk": 25}
    )
    assert epoch_postfix(stats, ["memory", "disk"]) == (
        "200 samples/s, memory 50%, disk 25%, miss 25%"
    )
    assert epoch_postfix(EpochStats(epoch=0), ["memory"]) == "0 samples/s"
