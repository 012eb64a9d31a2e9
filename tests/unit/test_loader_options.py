"""The loader's grouped options (``batching=``, ``augment=``, ``distributed=``): checked when
made, a plain callable as ``augment`` is ``Augment(fn)`` on the CPU, and the loader keeps
torch's names."""

from __future__ import annotations

import dataclasses
import inspect
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


def test_a_plain_callable_means_augment_on_the_cpu(
    tmp_path: Path, small_pipeline: Pipeline
) -> None:
    ds = MultimodalDataset(make_dataset(tmp_path / "data", 8, seed=1), pipeline=small_pipeline)
    plain = DataLoader(ds, cache=None, batch_size=4, augment=_flip)
    spec = DataLoader(ds, cache=None, batch_size=4, augment=Augment(_flip, device="cpu"))
    assert plain.augment == Augment(_flip)  # device None: the CPU
    _same(_batches(plain), _batches(spec))


def test_an_option_of_the_wrong_type_or_an_unknown_keyword_is_refused() -> None:
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
    named = list(inspect.signature(DataLoader.__init__).parameters)[1:]
    torch_params = set(inspect.signature(torch.utils.data.DataLoader.__init__).parameters)
    for name in ("prefetch_factor", "persistent_workers", "worker_init_fn", "timeout"):
        assert name in named and name in torch_params
    assert len(named) <= 20, named  # torch's has 17
