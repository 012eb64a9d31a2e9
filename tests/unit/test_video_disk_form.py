"""Video entries under ``Cache(disk_form="jpeg:Q")``: one JPEG per frame, within the form's
bound of the raw frames (PSNR >= 30 dB per frame at Q=90), decoded only into the size the
record's ``video_sizes`` declares (a stored entry declaring anything else is damaged)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from chat_support import make_tokenizer
from video_support import write_clip

import mmcache
from mmcache import ChatSpec, MultimodalDataset, Pipeline, VideoSpec, codec
from mmcache.codec.compact import parse_disk_form
from mmcache.errors import CorruptEntryError
from mmcache.transforms import VideoTokens

pytest.importorskip("av")
pytest.importorskip("jinja2")

#: The documented bound of the jpeg:90 form on a video frame (as on an image).
JPEG90_MIN_PSNR = 30.0
SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<video>"]


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture
def ds(tmp_path: Path) -> MultimodalDataset:
    write_clip(tmp_path / "v/a.mp4", frames=48, fps=24, size=(64, 96))
    write_clip(tmp_path / "v/b.mp4", frames=30, fps=15, size=(61, 97), pix_fmt="yuv444p")
    ask = [{"from": "human", "value": "<video>\nWhat?"}, {"from": "gpt", "value": "It moves."}]
    two = [{"from": "human", "value": "<video> <video>"}, {"from": "gpt", "value": "Two."}]
    records = [
        {"id": "a", "video": "v/a.mp4", "conversations": ask},
        {"id": "b", "video": "v/b.mp4", "conversations": ask},
        {"id": "ab", "video": ["v/b.mp4", "v/a.mp4"], "conversations": two},
    ]
    (tmp_path / "m.json").write_text(json.dumps(records))
    tok = make_tokenizer()
    tok.add_special_tokens(SPECIALS)
    pipe = Pipeline(
        text=ChatSpec(tok, "chatml", 4096, video=VideoTokens()),
        video=VideoSpec(min_pixels=8 * 28 * 28, max_pixels=24 * 28 * 28),
    )
    return MultimodalDataset(tmp_path / "m.json", pipeline=pipe)


def _frames(sample: dict[str, Any]) -> list[np.ndarray]:
    flat, out, at = np.asarray(sample["videos"]), [], 0
    for t, h, w in np.asarray(sample["video_sizes"]).tolist():
        out.extend(flat[at : at + t * 3 * h * w].reshape(t, 3, h, w))
        at += t * 3 * h * w
    return out


def test_jpeg_form_stores_one_jpeg_per_frame_within_its_bound(
    ds: MultimodalDataset, tmp_path: Path
) -> None:
    produced = [ds.produce(i) for i in range(len(ds))]
    with mmcache.Cache(tmp_path / "c", memory=0, disk="64MiB", disk_form="jpeg:90") as cache:
        list(mmcache.DataLoader(ds, cache=cache, batch_size=1, num_workers=0))
    with (
        mmcache.Cache(tmp_path / "c", memory=0, disk="64MiB", disk_form="jpeg:90") as jpeg,
        mmcache.Cache(tmp_path / "raw", memory=0, disk="64MiB") as raw,
    ):
        loader = mmcache.DataLoader(ds, cache=jpeg, batch_size=1, shuffle=False)
        batches = list(loader)
        assert loader.stats().epochs[0].tier_hits == {"disk": 3}
        for batch, want in zip(batches, produced, strict=True):
            assert torch.equal(batch["input_ids"][0][: len(want["input_ids"])],
                               torch.from_numpy(want["input_ids"]))  # fmt: skip
            np.testing.assert_array_equal(batch["video_sizes"].numpy(), want["video_sizes"])
            got = [f for c in batch["videos"] for f in c.numpy()]  # clips [t, 3, h, w]
            frames = _frames(want)
            assert len(got) == len(frames)
            for g, f in zip(got, frames, strict=True):
                assert g.shape == f.shape and g.dtype == np.uint8
                assert _psnr(g, f) >= JPEG90_MIN_PSNR
            assert not all(np.array_equal(g, f) for g, f in zip(got, frames, strict=True))
        for i in range(len(ds)):
            raw.put(ds.key(i), produced[i])
        assert jpeg.disk is not None and raw.disk is not None
        assert jpeg.disk.nbytes() * 3 < raw.disk.nbytes()  # smooth frames: >= 3x here


def test_a_video_entry_packs_per_frame_and_gathers_as_it_unpacks(ds: MultimodalDataset) -> None:
    form = parse_disk_form("jpeg:90")
    raw = codec.encode(ds.produce(2), ctime=3.0, cost=0.5)
    stored = form.pack(raw)
    body = codec.decode(stored)
    t = int(ds.produce(2)["video_sizes"][:, 0].sum())
    assert "videos" not in body and body["\x00jpegl:videos"].shape == (t,)
    back = form.unpack(stored)
    assert [f.name for f in codec.read_header(back).fields] == [
        f.name for f in codec.read_header(raw).fields
    ]
    assert len(back) == len(raw) and codec.verify(back)
    out = np.zeros((2, len(raw)), dtype=np.uint8)
    assert form.write_ranges(stored, [(0, len(raw), out)], 1)
    header = codec.read_header(back)
    start = header.table_end  # the bytes after the header: the fields, as unpack's
    assert bytes(out[1][start:]) == back[start:]


def _crafted(ds: MultimodalDataset, change: str) -> bytes:
    """The jpeg-form entry of sample 0, re-encoded with one thing of it changed (its
    checksum valid: a crafted file, not a flipped bit)."""
    form = parse_disk_form("jpeg:90")
    body = dict(codec.decode(form.pack(codec.encode(ds.produce(0)))))
    sizes = body["video_sizes"].copy()
    if change == "huge_sizes":
        sizes[0] = (4, 12000, 12000)  # declares 1.6 GiB of frames
    elif change == "many_frames":
        sizes[0, 0] = 1 << 30  # more frames than JPEGs stored
    elif change == "frame_size":
        sizes[0, 1] += 28  # every JPEG header then disagrees with the record
    elif change == "lengths":
        lengths = body["\x00jpegl:videos"].copy()
        lengths[0] += 1
        body["\x00jpegl:videos"] = lengths
    elif change == "no_sizes":
        del body["video_sizes"]
    body["video_sizes"] = sizes if change != "no_sizes" else np.zeros((0, 3), np.int32)
    return codec.encode(body, ctime=1.0, cost=1.0)


@pytest.mark.parametrize("change", ["huge_sizes", "many_frames", "frame_size", "lengths",
                                    "no_sizes"])  # fmt: skip
def test_a_video_entry_declaring_other_frames_is_damaged_never_allocated(
    ds: MultimodalDataset, change: str
) -> None:
    stored = _crafted(ds, change)
    form = parse_disk_form("jpeg:90")
    with pytest.raises(CorruptEntryError):
        form.unpack(stored, limit=64 << 20)
    raw_len = len(codec.encode(ds.produce(0)))
    out = np.zeros((1, raw_len), dtype=np.uint8)
    if change != "no_sizes":
        with pytest.raises(CorruptEntryError):
            form.write_ranges(stored, [(0, raw_len, out)], 0)
