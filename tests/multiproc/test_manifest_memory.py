"""Forked DataLoader workers reading every record do not copy numpy Records.

pytorch/pytorch#13246: a Dataset holding its manifest as a list of dicts makes each
forked worker copy the pages it reads, because reading a Python object writes its
reference count. Records keeps the manifest in numpy buffers, whose data pages are
only read, so they stay shared. This test measures each worker's private memory
(USS) before its first batch and after its last one, for both layouts.
"""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")

from torch.utils.data import DataLoader, Dataset, get_worker_info  # noqa: E402

from mmcache.sources import Records, read_manifest  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="needs fork and Linux USS accounting"
    ),
    # Four workers on a two-core runner is deliberate: the effect is per worker.
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

N_RECORDS = 200_000
BATCH = 1000
WORKERS = 4
MiB = 1024 * 1024


def _uss() -> int:
    return int(psutil.Process().memory_full_info().uss)


class _Touch(Dataset[int]):
    """Reads one record's id, text and image path per item; reports USS at batch edges.

    With a sequential sampler, batch ``b`` holds items ``b*BATCH .. b*BATCH+BATCH-1``:
    item 0 of a batch returns the worker's USS before the batch touches anything,
    item 1 the worker id, the last item the USS after the whole batch.
    """

    def __init__(self, n: int, touch: Callable[[int], int]) -> None:
        self.n = n
        self.touch = touch

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        pos = i % BATCH
        before = _uss() if pos == 0 else 0
        size = self.touch(i)
        if pos == 0:
            return before
        if pos == 1:
            info = get_worker_info()
            return -1 if info is None else int(info.id)
        if pos == BATCH - 1:
            return _uss()
        return size & 1


def _worker_growth(touch: Callable[[int], int]) -> dict[int, int]:
    """Run every record through forked workers; return each worker's USS growth in bytes."""
    loader = DataLoader(
        _Touch(N_RECORDS, touch),
        batch_size=BATCH,
        num_workers=WORKERS,
        multiprocessing_context="fork",
    )
    # Objects alive now (pytest, torch, the data) go to the permanent generation, so a
    # collection in a worker does not walk them: what is left is the refcount effect.
    gc.collect()
    gc.freeze()
    try:
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for batch in loader:
            worker = int(batch[1])
            first.setdefault(worker, int(batch[0]))
            last[worker] = int(batch[-1])
    finally:
        gc.unfreeze()
    assert sorted(first) == list(range(WORKERS))
    return {w: last[w] - first[w] for w in first}


@pytest.fixture(scope="module")
def manifest_lines(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    filler = "on a wooden table next to a window in the afternoon light"
    lines = [
        json.dumps(
            {
                "id": f"sample-{i:07d}",
                "image_path": f"images/{i % 1000:03d}/{i:07d}.jpg",
                "caption": f"a photo of object number {i} {filler}",
            }
        )
        for i in range(N_RECORDS)
    ]
    path = tmp_path_factory.mktemp("manifest") / "train.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, lines


def _dict_growth(lines: list[str]) -> dict[int, int]:
    # The seed pattern: a list of dicts from json.loads of the same lines.
    rows: list[dict[str, Any]] = [json.loads(line) for line in lines]

    def touch(i: int) -> int:
        rec = rows[i]
        return len(rec["id"]) + len(rec["caption"]) + len(rec["image_path"])

    return _worker_growth(touch)


def _records_growth(path: Path) -> dict[int, int]:
    records: Records = read_manifest(path)
    assert len(records) == N_RECORDS

    def touch(i: int) -> int:
        image = records.image_path(i)
        assert image is not None
        return len(records.id(i)) + len(records.text(i)) + len(image)

    return _worker_growth(touch)


def test_forked_workers_do_not_copy_numpy_records(
    manifest_lines: tuple[Path, list[str]],
) -> None:
    path, lines = manifest_lines
    dict_growth = _dict_growth(lines)
    gc.collect()  # the list of dicts is gone before the second run forks
    records_growth = _records_growth(path)

    report = (
        f"USS growth per worker, list of dicts: "
        f"{[round(g / MiB, 1) for g in dict_growth.values()]} MiB; "
        f"numpy Records: {[round(g / MiB, 1) for g in records_growth.values()]} MiB"
    )
    # The baseline must show the effect, or the comparison proves nothing.
    assert min(dict_growth.values()) > 20 * MiB, report
    assert max(records_growth.values()) < 0.25 * min(dict_growth.values()), report
