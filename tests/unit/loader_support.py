"""Shared pieces of the loader tests: one epoch's batches, and bitwise equality of two runs."""

from __future__ import annotations

from typing import Any

import torch

from mmcache.loader import DataLoader

#: The fields of the tests' 64 px image-caption samples.
FIELDS = ("image", "input_ids", "attention_mask")


def epoch_batches(loader: DataLoader, epoch: int) -> list[dict[str, Any]]:
    """Every batch of ``epoch``."""
    loader.set_epoch(epoch)
    return list(loader)


def same_batches(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """Assert two runs' batches hold the same samples, bit for bit."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x["id"] == y["id"]
        for name in FIELDS:
            assert torch.equal(x[name], y[name]), name
