"""``warm_features``: precompute and store the features of a whole dataset, resumably, per rank.

The feature counterpart of :func:`mmcache.warm` (which stores decoded samples);
it reports a :class:`FeatureWarmReport`. Each image is produced through
:func:`~mmcache.readthrough.read_through` (``cache=None``: produced, timed, and a bad
sample returned as a reject, in the decoding worker); the features are encoded in
batches here and stored by :meth:`~mmcache.features.FeatureCache.store`. No claims:
the encoder runs on a batch in this process, after the worker's decode, so a claim
could not cover a sample's whole preparation (ranks take disjoint shards anyway).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from mmcache.checks import check_int
from mmcache.dist import rank_and_world, shard_bounds
from mmcache.errors import ConfigError, SampleError
from mmcache.readthrough import read_through
from mmcache.sources.capabilities import index_count, layout_of

if TYPE_CHECKING:
    from mmcache.dataset import MultimodalDataset
    from mmcache.features import FeatureCache
    from mmcache.sources.base import SampleSource

    # What warm_features reads of a dataset (len, key, produce, on_error,
    # record_reject) is SampleSource's; MultimodalDataset is named beside it only
    # until it declares every member of the protocol (the sources restructure).
    Source: TypeAlias = SampleSource | MultimodalDataset

__all__ = ["FeatureWarmReport", "warm_features"]


@dataclass(frozen=True)
class FeatureWarmReport:
    """What :func:`warm_features` did on this rank.

    ``total`` samples were in this rank's shard; ``skipped`` were already
    stored, ``computed`` were encoded and stored now, ``rejected`` could not be
    produced (``on_error="skip"``).
    """

    rank: int
    world_size: int
    total: int
    skipped: int
    computed: int
    rejected: int
    seconds: float
    encoder_seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Produced:
    index: int
    image: npt.NDArray[Any] | None
    error: SampleError | None


class _WarmImages(torch.utils.data.Dataset[_Produced]):
    """The images of the samples still to encode (picklable: runs in DataLoader workers)."""

    def __init__(self, dataset: Source, indices: list[int], keys: dict[int, bytes]) -> None:
        self.dataset = dataset
        self.indices = indices
        self.keys = keys
        # cached [H, W, 3]: the encoder sees [3, H, W]
        self.transpose = "image" in layout_of(dataset).channels_last

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> _Produced:
        index = self.indices[j]
        ds = self.dataset
        # "skip": returned, not raised; the parent re-raises it unwrapped or records it
        got = read_through(None, self.keys[index], lambda: ds.produce(index), on_error="skip")
        if got.sample is None:
            return _Produced(index, None, got.error)
        image = got.sample.get("image")
        if image is None:
            raise ConfigError("warm_features needs a pipeline with an ImageSpec (no 'image' field)")
        if self.transpose and image.ndim == 3:
            image = image.transpose(2, 0, 1)
        return _Produced(index, image, None)


def _collate_list(items: list[_Produced]) -> list[_Produced]:
    return items


def warm_features(
    dataset: Source,
    feats: FeatureCache,
    *,
    batch_size: int = 64,
    rank: int | None = None,
    world_size: int | None = None,
    progress: bool = True,
    num_workers: int = 0,
) -> FeatureWarmReport:
    """Compute and store the features of every sample of ``dataset`` (any :class:`SampleSource`).

    Resumable: a sample whose features the Cache already holds is skipped
    before its image is even decoded, so a run killed midway and started again
    encodes only the rest. Under ``torchrun`` each rank takes a disjoint
    contiguous part (:func:`shard_bounds`; ``rank``/``world_size`` default to
    torch.distributed's when it is initialised); no collective is called, so
    ranks finish independently. ``num_workers`` processes decode images
    (torch DataLoader workers); the encoder runs here. The progress bar
    (tqdm) shows on rank 0. Rejected samples follow ``dataset.on_error``.
    """
    if feats.cache is None:
        raise ConfigError("warm_features needs a FeatureCache with a Cache (cache=None)")
    check_int("batch_size", batch_size, minimum=1)
    check_int("num_workers", num_workers, minimum=0)
    rank, world_size = rank_and_world(rank, world_size)
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    enc0 = feats.stats().encoder_seconds
    start, stop = shard_bounds(index_count(dataset), rank, world_size)
    todo: list[int] = []
    todo_keys: dict[int, bytes] = {}
    for i in range(start, stop):
        sk = dataset.key(i)
        if not feats.cache.contains(feats.feature_key(sk)):
            todo.append(i)
            todo_keys[i] = sk
    total = stop - start
    skipped = total - len(todo)
    computed = rejected = 0
    loader = torch.utils.data.DataLoader(
        _WarmImages(dataset, todo, todo_keys),
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=_collate_list,
    )
    desc = "features" if world_size == 1 else f"features (rank {rank}/{world_size})"
    with tqdm(
        total=total, initial=skipped, desc=desc, unit="img", disable=not progress or rank != 0
    ) as bar:
        for items in loader:
            good: list[_Produced] = []
            for item in items:
                if item.error is None:
                    good.append(item)
                elif dataset.on_error == "raise":
                    raise item.error
                else:
                    dataset.record_reject(item.error)
                    rejected += 1
            if good:
                images = torch.from_numpy(
                    np.stack([item.image for item in good if item.image is not None])
                )
                computed += feats.store([todo_keys[item.index] for item in good], images)
            bar.update(len(items))
    feats.flush()
    return FeatureWarmReport(
        rank=rank,
        world_size=world_size,
        total=total,
        skipped=skipped,
        computed=computed,
        rejected=rejected,
        seconds=time.perf_counter() - t0,
        encoder_seconds=feats.stats().encoder_seconds - enc0,
    )
