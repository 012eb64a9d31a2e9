"""The memory tier is the only copy of cached data on the node: memory does not multiply
with DataLoader workers (issue 4, "Memory")."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import warnings
from pathlib import Path

import psutil
import pytest

import mmcache as mc


def _total_pss() -> int:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc: return freed heap pages
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    me = psutil.Process()
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except psutil.NoSuchProcess:
            continue
    return total


def _run(ds: mc.MultimodalDataset, root: Path, workers: int) -> int:
    """Two epochs (cold, warm) with persistent workers; the loader tree's PSS afterwards."""
    cache = mc.Cache(root, memory="1GiB", temporary=True)
    loader = mc.DataLoader(
        ds, cache=cache, batch_size=32, num_workers=workers, persistent_workers=True
    )
    try:
        for epoch in range(2):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
        assert loader.stats().epochs[1].hit_rate == 1.0
        return _total_pss()
    finally:
        loader.close()
        if cache.memory is not None:
            cache.memory.unlink()  # type: ignore[attr-defined]
        cache.close()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux PSS")
def test_node_memory_grows_with_data_once_not_per_worker(tmp_path: Path) -> None:
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    manifest = mc.synth.make_dataset(tmp_path / "data", 560, seed=2)
    small = tmp_path / "data" / "small.jsonl"
    small.write_text("".join(manifest.read_text().splitlines(keepends=True)[:80]))
    tok = mc.train_tokenizer(mc.synth.synth_captions(200), vocab_size=300)
    pipe = mc.Pipeline(image=mc.ImageSpec(size=224), text=mc.TextSpec(tok, max_length=16))
    big_ds = mc.MultimodalDataset(manifest, pipeline=pipe)
    small_ds = mc.MultimodalDataset(small, pipeline=pipe)
    entry = mc.codec.encoded_size(big_ds.produce(0))
    extra_data = (len(big_ds) - len(small_ds)) * entry  # ~70 MiB more cached data

    workers = 3
    base = _run(small_ds, tmp_path / "c-small", workers)
    big = _run(big_ds, tmp_path / "c-big", workers)
    growth = big - base
    # One copy on the node: the growth is about the extra data once (the shared segment)
    # plus allocator slack from decoding more images (10-25 MiB per process here), not
    # (1 + workers) = 4 times the data as with a cache inside each worker's dataset.
    assert growth < 2.5 * extra_data, (growth / 2**20, extra_data / 2**20)
