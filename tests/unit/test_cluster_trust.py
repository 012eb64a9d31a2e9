"""G26: peers of ``scope="cluster"`` exchange plain arrays; received entries are checked.

* The topology is gathered as int64 tensors (``all_gather``), never with
  ``all_gather_object``, which unpickles every peer's object: run here on a real
  one-rank gloo group with pickle's loaders patched to raise.
* A received entry is refused unless it is what this rank would make: its key
  (pipeline fingerprint + input identity), its checksum and, for fixed-shape
  sources, its layout. A pickle sent as an entry or as a whole message is refused.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from mmcache import codec
from mmcache.cluster.received import EntryCheck
from mmcache.cluster.topology import Topology, decode_row, encode_row
from mmcache.cluster.wire import unpack
from mmcache.errors import ConfigError

dist = pytest.importorskip("torch.distributed")


@pytest.fixture
def one_rank_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    monkeypatch.setenv("MMCACHE_NODE", "node-α")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_topology_is_gathered_without_unpickling(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a peer's bytes were unpickled")

    monkeypatch.setattr(dist, "all_gather_object", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    topology = Topology.gather(123456789)
    assert topology.names == ("node-α",) and topology.budgets == (123456789,)
    assert topology.node_of == (0,) and topology.rank == 0


def test_a_malformed_node_record_is_a_config_error_naming_the_rank() -> None:
    row = encode_row("gpu-node-7", 2**40)
    assert decode_row(row, 0) == ("gpu-node-7", 2**40)
    bad_len, bad_byte, bad_budget = row.clone(), row.clone(), row.clone()
    bad_len[1] = 10**6
    bad_byte[3] = 999
    bad_budget[0] = -1
    for bad in (bad_len, bad_byte, bad_budget, torch.zeros_like(row)):
        with pytest.raises(ConfigError, match="rank 3"):
            decode_row(bad, 3)
    with pytest.raises(ConfigError, match="longer than"):
        encode_row("x" * 300, 1)


def _entry(pixels: np.ndarray) -> bytes:
    return bytes(codec.encode({"image": pixels, "label": np.array([1], dtype=np.int64)}))


def test_received_entries_must_be_what_this_rank_would_make(tmp_path: Path) -> None:
    key = bytes(range(16))
    own = _entry(np.zeros((3, 8, 8), dtype=np.uint8))
    check = EntryCheck(fixed_shapes=True)
    check.learn(own)  # an entry of this node's own tiers
    assert check.refusal(key, key, _entry(np.full((3, 8, 8), 7, dtype=np.uint8))) is None
    other_shape = _entry(np.zeros((3, 2, 2), dtype=np.uint8))  # a valid checksum
    assert codec.verify(other_shape)
    assert "shapes differ" in str(check.refusal(key, key, other_shape))
    assert "key" in str(check.refusal(key, bytes(16), own))  # another pipeline or input
    assert "key" in str(check.refusal(None, key, own))  # an index out of range
    damaged = bytearray(own)
    damaged[-1] ^= 0xFF
    assert "checksum" in str(check.refusal(key, key, bytes(damaged)))
    marker = tmp_path / "pwned"
    payload = pickle.dumps(eval, protocol=4) + str(marker).encode()  # never loaded
    assert "checksum" in str(check.refusal(key, key, payload))
    with pytest.raises(ValueError, match="exchange message"):
        unpack(np.frombuffer(payload, dtype=np.uint8))
    assert not marker.exists()


def test_varying_shapes_are_checked_by_key_and_checksum_only() -> None:
    key = bytes(range(16))
    check = EntryCheck(fixed_shapes=False)
    check.learn(_entry(np.zeros((3, 8, 8), dtype=np.uint8)))
    assert check.refusal(key, key, _entry(np.zeros((3, 2, 6), dtype=np.uint8))) is None
