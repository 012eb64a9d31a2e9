"""The loader's grouped options (``batching=``, ``augment=``, ``distributed=``) and the flat
spellings of the last release: each old keyword warns, names its new spelling, and still
gives the same batches."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from mmcache import DataLoader, MultimodalDataset, PackSpec, Pipeline
from mmcache.errors import ConfigError
from mmcache.loader import Augment, Distributed, SFTBatching
from mmcache.synth import make_dataset
from mmcache.testing.sft import SyntheticSFTSource


def _flip(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return images.flip(-1)


def _batches(loader: DataLoader) -> list[dict[str, Any]]:
    loader.set_epoch(1)
    return list(loader)


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for name, value in x.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, y[name]), name
            elif isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
                assert all(torch.equal(p, q) for p, q in zip(value, y[name], strict=True))
            else:
                assert value == y[name], name


SRC = SyntheticSFTSource(12, seed=3, pad_token_id=7)

# old flat keywords -> the new spelling with the same meaning
CASES: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    ({"pad_token_id": 1}, {"batching": SFTBatching(pad_token_id=1)}, "SFTBatching"),
    ({"pad_to_multiple_of": 1}, {"batching": SFTBatching(pad_to_multiple_of=1)}, "SFTBatching"),
    ({"group_by_length": True}, {"batching": SFTBatching(group_by_length=True)}, "SFTBatching"),
    (
        {"pack": PackSpec(max_tokens=256), "batch_size": 1},
        {"batching": SFTBatching(pack=PackSpec(max_tokens=256)), "batch_size": 1},
        "SFTBatching",
    ),
    (
        {"rank": 1, "world_size": 2},
        {"distributed": Distributed(rank=1, world_size=2)},
        "Distributed",
    ),
    (
        {"distributed_drop_last": True, "rank": 0, "world_size": 5},
        {"distributed": Distributed(rank=0, world_size=5, drop_last=True)},
        "Distributed",
    ),
    ({"prefetch": 3}, {"prefetch_factor": 3}, "prefetch_factor"),
]


@pytest.mark.parametrize(("old", "new", "named"), CASES, ids=lambda c: str(c)[:40])
def test_each_old_keyword_warns_naming_the_new_spelling_and_gives_the_same_batches(
    old: dict[str, Any], new: dict[str, Any], named: str
) -> None:
    base = {"cache": None, "batch_size": 4, "seed": 2}
    with pytest.warns(DeprecationWarning, match=named) as caught:
        before = DataLoader(SRC, **{**base, **old})
    assert all("deprecated" in str(w.message) for w in caught)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        after = DataLoader(SRC, **{**base, **new})
    assert len(before) == len(after)
    _same(_batches(before), _batches(after))


def test_device_alone_is_deprecated_and_a_plain_callable_means_augment_on_the_cpu(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    ds = MultimodalDataset(make_dataset(tmp_path / "data", 8, seed=1), pipeline=small_pipeline)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        plain = DataLoader(ds, cache=None, batch_size=4, augment=_flip)
        spec = DataLoader(ds, cache=None, batch_size=4, augment=Augment(_flip, device="cpu"))
    assert plain.augment == Augment(_flip)  # device None: the CPU
    with pytest.warns(DeprecationWarning, match=r"augment=Augment\(device=\.\.\.\)"):
        old = DataLoader(ds, cache=None, batch_size=4, augment=_flip, device="cpu")
    assert old.augment == Augment(_flip, device="cpu")
    _same(_batches(old), _batches(spec))
    _same(_batches(plain), _batches(spec))
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="augment is None"):
        DataLoader(ds, cache=None, batch_size=4, device="cpu")


def test_an_old_keyword_beside_its_new_object_or_an_unknown_one_is_refused() -> None:
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="inside batching"):
        DataLoader(SRC, cache=None, batch_size=4, batching=SFTBatching(), pad_token_id=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'pad_id'"):
        DataLoader(SRC, cache=None, batch_size=4, pad_id=1)
    with pytest.raises(ConfigError, match="batching must be a SFTBatching"):
        DataLoader(SRC, cache=None, batch_size=4, batching={"pad_token_id": 1})  # type: ignore[arg-type]


def test_the_option_objects_check_their_fields_when_made_and_are_frozen() -> None:
    with pytest.raises(ConfigError, match="pad_to_multiple_of"):
        SFTBatching(pad_to_multiple_of=0)
    with pytest.raises(ConfigError, match="exclusive"):
        SFTBatching(group_by_length=True, pack=PackSpec(max_tokens=64))
    with pytest.raises(ConfigError, match="PackSpec"):
        SFTBatching(pack=64)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="callable"):
        Augment("flip")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="drop_last"):
        Distributed(drop_last=1)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SFTBatching().pad_token_id = 3  # type: ignore[misc]


def test_the_loader_keeps_torchs_names_and_takes_few_parameters() -> None:
    params = list(inspect.signature(DataLoader.__init__).parameters)[1:]
    named = [p for p in params if p != "deprecated"]
    torch_params = set(inspect.signature(torch.utils.data.DataLoader.__init__).parameters)
    for name in ("prefetch_factor", "persistent_workers", "worker_init_fn", "timeout"):
        assert name in named and name in torch_params
    assert len(named) <= 20, named  # torch's has 17
