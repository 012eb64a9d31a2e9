"""warm_features under torch.distributed: two gloo ranks warm disjoint shards of one dataset.

Each rank is a spawned process with its own encoder (same seed, same weights) and
its own handle on one shared disk tier. Together they must store every sample's
features exactly once: the shards are disjoint, their union is the dataset, and the
encoder ran on N samples in total. A fresh FeatureCache then serves everything
without calling the encoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

from torch import nn  # noqa: E402

from mmcache.cache import Cache  # noqa: E402
from mmcache.dataset import MultimodalDataset  # noqa: E402
from mmcache.features import FeatureCache, warm_features  # noqa: E402
from mmcache.synth import make_dataset  # noqa: E402
from mmcache.transforms import ImageSpec  # noqa: E402
from mmcache.transforms.pipeline import Pipeline  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

N = 14
WORLD = 2
SIZE = 32


class TinyViT(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 8, 8)
        self.block = nn.TransformerEncoderLayer(dim, 4, 2 * dim, batch_first=True)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.block(self.embed(x).flatten(2).transpose(1, 2)))


def to_float(x: torch.Tensor) -> torch.Tensor:
    return x.float() / 255


def make_feats(cache: Cache) -> tuple[FeatureCache, list[int]]:
    torch.manual_seed(0)
    enc = TinyViT()
    calls: list[int] = []
    enc.register_forward_hook(lambda mod, args, out: calls.append(int(args[0].shape[0])))
    feats = FeatureCache(
        enc, cache=cache, preprocess=to_float, dtype=torch.float16, memory=0, batch_size=4
    )
    return feats, calls


def _rank_main(rank: int, tmp: str, manifest: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=WORLD)
    try:
        ds = MultimodalDataset(manifest, pipeline=Pipeline(image=ImageSpec(size=SIZE)))
        with Cache(Path(tmp) / "cache", memory=0, disk="64MiB") as cache:
            feats, calls = make_feats(cache)
            report = warm_features(ds, feats, batch_size=4, progress=False)  # rank from dist
            stored = [i for i in range(N) if feats.contains(ds.key(i))]
        out: dict[str, Any] = {
            "report": report.as_dict(),
            "encoded": sum(calls),
            "stored_after": stored,
        }
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_warm_disjoint_shards_that_cover_the_dataset(tmp_path: Path) -> None:
    manifest = make_dataset(tmp_path / "data", N, seed=8, workers=1)
    mp.spawn(_rank_main, args=(str(tmp_path), str(manifest)), nprocs=WORLD, join=True)

    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    reports = [r["report"] for r in results]
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["world_size"] == WORLD for r in reports)
    assert [r["total"] for r in reports] == [7, 7]
    assert all(r["skipped"] == 0 and r["rejected"] == 0 for r in reports)
    assert sum(r["computed"] for r in reports) == N
    assert sum(r["encoded"] for r in results) == N  # no sample encoded twice
    # Each rank stored (at least) its own contiguous shard; together: everything, once.
    assert set(range(0, 7)) <= set(results[0]["stored_after"])
    assert set(range(7, 14)) <= set(results[1]["stored_after"])

    ds = MultimodalDataset(manifest, pipeline=Pipeline(image=ImageSpec(size=SIZE)))
    with Cache(tmp_path / "cache", memory=0, disk="64MiB") as cache:
        feats, calls = make_feats(cache)
        assert all(feats.contains(ds.key(i)) for i in range(N))
        served = feats.get([ds.key(i) for i in range(N)])  # no images: all must hit
        assert calls == [] and served.shape[0] == N
        again = warm_features(ds, feats, rank=0, world_size=1, progress=False)
        assert (again.skipped, again.computed) == (N, 0)
