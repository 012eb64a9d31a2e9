"""Video SFT samples: decode in ``__getitem__`` every epoch against mmcache (issue 29). Not a test.

Side by side in one run, on the same synthetic H.264 clips (640x360, 24 fps, 10-30 s,
one ``<video>`` per record), batch size 1, 2 workers each:

(a) a torch DataLoader whose dataset does what ``qwen-vl-utils``' ``fetch_video`` does per
    sample, every epoch, with its frame rules (mmcache's port of them): open the clip,
    find the frames, decode the kept ones seeking to them (PyAV: the fastest reader this
    install has, so the baseline is not a straw man: ``qwen-vl-utils`` here would fall
    back to torchvision's ``read_video``, which decodes every frame), resize bicubic with
    antialias and make float32, as ``fetch_video`` returns; then the chat encode
    (``ChatSpec``) for the same record;
(b) ``mmcache.DataLoader`` over ``Pipeline(text=ChatSpec(video=...), video=VideoSpec(...))``:
    the cold epoch (the same decode, kept uint8, admitted to the cache);
(c) the warm epochs (every sample from the memory tier). Both (b) and (c) turn each
    served clip into float32 in the timing, so both sides hand over the same tensors.

Also: the bytes one sample takes in the disk tier, read from the cache itself (each
sample put in a ``Cache(disk_form="raw")`` and a ``Cache(disk_form="jpeg:90")``, one
JPEG per frame; the tier's ``nbytes()``), against the float32 frames of (a).

    .venv/bin/python benchmarks/video.py                # 8 clips
    .venv/bin/python benchmarks/video.py --clips 16 --epochs 3 --data /tmp/clips
    .venv/bin/python benchmarks/video.py --decoders     # decode speed: PyAV, torchcodec
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch

import mmcache
from mmcache import ChatSpec, MultimodalDataset, Pipeline, VideoSpec
from mmcache.transforms import VideoTokens
from mmcache.transforms.chat import Chat
from mmcache.transforms.video_decode import load_clip

SPECIALS = [
    "<image>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|video_pad|>",
]
SPEC = VideoSpec(fps=1.0, max_pixels=160 * 28 * 28)


def write_clip(path: Path, seconds: int, seed: int) -> None:
    """An H.264 clip of 640x360 at 24 fps: a moving gradient and square, plus noise."""
    rng = np.random.default_rng(seed)
    h, w, fps = 360, 640, 24
    y, x = np.mgrid[0:h, 0:w]
    with av.open(str(path), "w", format="mp4") as out:
        stream = out.add_stream("h264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"preset": "ultrafast", "g": "48", "crf": "23"}
        for i in range(seconds * fps):
            img = np.empty((h, w, 3), np.uint8)
            img[..., 0] = (x + 3 * i) % 256
            img[..., 1] = (y + 2 * i) % 256
            img[..., 2] = (x + y + i) % 256
            top, left = (5 * i) % (h - 60), (7 * i) % (w - 60)
            img[top : top + 60, left : left + 60] = rng.integers(0, 256, 3)
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts, frame.time_base = i, Fraction(1, fps)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def make_data(root: Path, n: int) -> Path:
    rng = random.Random(0)
    records = []
    for i in range(n):
        write_clip(root / f"v{i}.mp4", rng.randint(10, 30), i)
        records.append({
            "id": f"clip{i}",
            "video": f"v{i}.mp4",
            "conversations": [
                {"from": "human", "value": "<video>\nWhat moves in this clip?"},
                {"from": "gpt", "value": f"A square crosses the frame, clip {i}."},
            ],
        })  # fmt: skip
    manifest = root / "train.json"
    manifest.write_text(json.dumps(records))
    return manifest


def chat_spec() -> ChatSpec:
    tok = mmcache.train_tokenizer(["what moves in this clip a square crosses the frame"] * 4)
    tok.add_special_tokens(SPECIALS)
    return ChatSpec(tok, "chatml", 32768, video=VideoTokens())


class QwenStyleDataset(torch.utils.data.Dataset[dict[str, Any]]):
    """(a): ``fetch_video``'s work in ``__getitem__``, every epoch."""

    def __init__(self, manifest: Path) -> None:
        self.records = mmcache.read_manifest(manifest)
        self.chat = chat_spec()

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, Any]:
        part = self.records.videos(i)[0]
        clip = load_clip(SPEC.for_part(part), part["video"], sample_id=self.records.id(i))
        video = torch.from_numpy(clip.frames).float()  # what fetch_video returns
        msgs = self.records.chat(i)
        assert msgs is not None
        enc = self.chat.encode(Chat(tuple(msgs), (), (clip.shape,)))
        return {"video": video, "input_ids": torch.from_numpy(enc.input_ids)}


def _first(batch: list[dict[str, Any]]) -> dict[str, Any]:
    return batch[0]


def epoch_time(loader: Any, *, to_float: bool) -> float:
    start = time.perf_counter()
    for batch in loader:
        if to_float:
            for clip in batch["videos"]:
                clip.float()
    return time.perf_counter() - start


def cached_bytes(ds: MultimodalDataset, root: Path) -> tuple[float, float, float]:
    """Mean bytes per sample as the disk tier stores it, raw and in the ``jpeg:90`` form
    (each sample put in a cache of each form, its disk tier's ``nbytes()`` read back),
    and the float32 frames (a)'s ``fetch_video`` makes of the same clips."""
    n = len(ds)
    samples = [ds.produce(i) for i in range(n)]
    out = []
    for form in ("raw", "jpeg:90"):
        with mmcache.Cache(root / f"bytes-{form.replace(':', '')}", memory=0, disk="8GiB",
                           disk_form=form) as cache:  # fmt: skip
            for i, sample in enumerate(samples):
                cache.put(ds.key(i), sample)
            assert cache.disk is not None
            out.append(cache.disk.nbytes() / n)
    out.append(sum(s["videos"].nbytes * 4 for s in samples) / n)
    return out[0], out[1], out[2]


def decoder_speed(args: argparse.Namespace) -> None:
    """One decode of every clip (``load_clip``: demux, the kept frames decoded and resized)
    with each decoder that loads, in one process, alternating: clips/s and kept
    frames/s, the best of three rounds, and the largest difference of their frames."""
    from dataclasses import replace

    from mmcache.transforms.video_torchcodec import torchcodec_loads, unavailable_reason

    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or Path(tmp)
        data.mkdir(parents=True, exist_ok=True)
        manifest = data / "train.json"
        if not manifest.exists() or len(json.loads(manifest.read_text())) != args.clips:
            manifest = make_data(data, args.clips)
        clips = [data / r["video"] for r in json.loads(manifest.read_text())]
        decoders = ["pyav"] + (["torchcodec"] if torchcodec_loads() else [])
        if len(decoders) == 1:
            print(f"torchcodec does not load here ({unavailable_reason()}): PyAV only")
        best: dict[str, float] = {}
        frames: dict[str, list[np.ndarray]] = {}
        for _ in range(3):
            for name in decoders:
                spec = replace(SPEC, decoder=name)
                t0 = time.perf_counter()
                got = [load_clip(spec, c, sample_id=c.name).frames for c in clips]
                best[name] = min(best.get(name, float("inf")), time.perf_counter() - t0)
                frames[name] = got
        kept = sum(f.shape[0] for f in frames["pyav"])
        for name in decoders:
            rate = f"{len(clips) / best[name]:.2f} clips/s, {kept / best[name]:.1f} kept frames/s"
            print(f"{name:>10}: {rate} ({best[name]:.2f}s for {len(clips)})")
        if "torchcodec" in frames:
            diff = max(
                int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())
                for a, b in zip(frames["pyav"], frames["torchcodec"], strict=True)
            )
            print(f"largest frame difference, torchcodec vs PyAV: {diff} levels")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3, help="epochs of (a) and warm (c)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--data", type=Path, help="keep (and reuse) the clips in this folder")
    parser.add_argument(
        "--decoders", action="store_true",
        help="only time one decode of every clip with each decoder (PyAV, torchcodec)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.decoders:
        decoder_speed(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = args.data or root
        data.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        manifest = data / "train.json"
        if not manifest.exists() or len(json.loads(manifest.read_text())) != args.clips:
            manifest = make_data(data, args.clips)
        print(f"{args.clips} clips written in {time.perf_counter() - t0:.1f}s")
        base = torch.utils.data.DataLoader(
            QwenStyleDataset(manifest), batch_size=1, num_workers=args.workers,
            collate_fn=_first, persistent_workers=True,
        )  # fmt: skip
        a = [epoch_time(base, to_float=False) for _ in range(args.epochs)]
        ds = MultimodalDataset(manifest, pipeline=Pipeline(text=chat_spec(), video=SPEC))
        cache = mmcache.Cache(root / "cache", memory="2GiB", disk=None)
        try:
            loader = mmcache.DataLoader(ds, cache=cache, batch_size=1, num_workers=args.workers)
            b = epoch_time(loader, to_float=True)
            c = [epoch_time(loader, to_float=True) for _ in range(args.epochs)]
            hits = loader.stats()
        finally:
            cache.close()
        sizes = cached_bytes(ds, root)
    med_a, med_c = statistics.median(a), statistics.median(c)
    print(f"(a) qwen-style __getitem__ epoch: {med_a:.2f}s (median of {a})")
    print(f"(b) mmcache cold epoch:           {b:.2f}s  -> {med_a / b:.2f}x (a)")
    print(f"(c) mmcache warm epoch:           {med_c:.3f}s -> {med_a / med_c:.1f}x (a)")
    raw, jpg, f32 = (x / 2**20 for x in sizes)
    print(f"bytes per sample: raw {raw:.1f} MiB, jpeg:90 {jpg:.2f} MiB, float32 {f32:.1f} MiB")
    print(f"stats: {hits}")


if __name__ == "__main__":
    main()
