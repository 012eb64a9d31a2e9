"""VideoFrameSampler on packed batches (``pack=PackSpec(...)``) and on LLaVA-Video's
per-frame image runs: the kept frames' tokens only, labels moved with them, the packed
row's ``cu_seqlens``/``position_ids``/``max_seqlen`` counting the kept tokens; the same
draws with any number of workers and after a resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chat_support import make_tokenizer
from video_support import run_epochs, write_clip

import mmcache
from mmcache import ChatSpec, MultimodalDataset, PackSpec, Pipeline, VideoSpec
from mmcache.loader import SFTBatching
from mmcache.loader.video_frames import VideoFrameSampler
from mmcache.transforms import VideoTokens

pytest.importorskip("av")
pytest.importorskip("jinja2")

SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<video>", "<image>"]
KEEP = 2  # frames kept per clip
IMAGE_TOKENS = 3  # per frame, in the per-frame form


def _tokenizer() -> Any:
    tok = make_tokenizer()
    tok.add_special_tokens(SPECIALS)
    return tok


def _pipeline(per_frame: bool) -> Pipeline:
    tok = _tokenizer()
    if per_frame:
        wrap = {"image_prefix": "<|vision_start|>", "image_suffix": "<|vision_end|>"}
        video = VideoTokens(per_frame=True)
        chat = ChatSpec(tok, "chatml", 4096, image_tokens=IMAGE_TOKENS, video=video, **wrap)
    else:
        chat = ChatSpec(tok, "chatml", 4096, video=VideoTokens())
    return Pipeline(text=chat, video=VideoSpec(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28))


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    write_clip(tmp_path / "v/a.mp4", frames=48, fps=24, size=(64, 96))
    write_clip(tmp_path / "v/b.mp4", frames=75, fps=25, size=(72, 128))
    ask = [{"from": "human", "value": "<video>\nWhat happens?"},
           {"from": "gpt", "value": "It moves."}]  # fmt: skip
    two = [{"from": "human", "value": "<video> then <video>"}, {"from": "gpt", "value": "Two."}]
    records = [
        {"id": "a", "video": "v/a.mp4", "conversations": ask},
        {"id": "b", "video": "v/b.mp4", "conversations": ask},
        {"id": "ab", "video": ["v/b.mp4", "v/a.mp4"], "conversations": two},
        {"id": "a2", "video": "v/a.mp4", "conversations": ask},
    ]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(records))
    return path


def _run(
    manifest: Path, root: Path, *, per_frame: bool, workers: int, resume_after: int | None = None
) -> list[dict[str, Any]]:
    """Every packed batch of two epochs (as plain lists), optionally stopped after
    ``resume_after`` batches and resumed from the loader's state."""
    pipe = _pipeline(per_frame)
    ds = MultimodalDataset(manifest, pipeline=pipe)
    hook = VideoFrameSampler.for_chat(pipe.chat, KEEP, pad_token_id=ds.pad_token_id)
    pack = PackSpec(max_tokens=int(ds.lengths().max()) * 2)
    with mmcache.Cache(root, memory="64MiB", disk="128MiB") as cache:

        def make() -> mmcache.DataLoader:
            return mmcache.DataLoader(ds, cache=cache, batch_size=1, seed=5,
                                      batching=SFTBatching(pack=pack),
                                      num_workers=workers, hooks=[hook])  # fmt: skip

        def record(epoch: int, batch: dict[str, Any]) -> dict[str, Any]:
            return {
                "epoch": epoch, "id": list(batch["id"]),
                "input_ids": batch["input_ids"][0].tolist(),
                "labels": batch["labels"][0].tolist(),
                "position_ids": batch["position_ids"][0].tolist(),
                "cu": batch["cu_seqlens"].tolist(), "max_seqlen": batch["max_seqlen"],
                "sizes": batch["video_sizes"].tolist(),
                "frames": [[int(f.sum()) for f in c] for c in batch["videos"]],
                "counts": batch["video_counts"].tolist(),
            }  # fmt: skip

        out = run_epochs(make, record, resume_after=resume_after)
    return out


@pytest.mark.parametrize("per_frame", [False, True], ids=["qwen", "per_frame"])
def test_packed_batches_keep_the_sampled_frames_tokens_exactly(
    manifest: Path, cache_root: Path, per_frame: bool
) -> None:
    runs = _run(manifest, cache_root, per_frame=per_frame, workers=0)
    assert sorted(i for b in runs if b["epoch"] == 0 for i in b["id"]) == ["a", "a2", "ab", "b"]
    ds = MultimodalDataset(manifest, pipeline=_pipeline(per_frame))
    tok = _tokenizer()
    pad, img = tok.token_to_id("<|video_pad|>"), tok.token_to_id("<image>")
    start = tok.token_to_id("<|vision_start|>")
    for b in runs:
        cu = b["cu"]
        assert cu[-1] == len(b["input_ids"]) == len(b["labels"]) == len(b["position_ids"])
        assert b["max_seqlen"] == max(np.diff(cu))
        v = 0
        for s, sid in enumerate(b["id"]):
            ids, labels = b["input_ids"][cu[s] : cu[s + 1]], b["labels"][cu[s] : cu[s + 1]]
            assert b["position_ids"][cu[s] : cu[s + 1]] == list(range(cu[s + 1] - cu[s]))
            want = ds.produce(ds.records.index_of(sid))
            n = len(want["video_sizes"])
            sizes = b["sizes"][v : v + n]
            for (t, h, w), (t0, h0, w0) in zip(sizes, want["video_sizes"].tolist(), strict=True):
                assert t == min(KEEP, t0) and (h, w) == (h0, w0)
            if per_frame:
                assert ids.count(img) == sum(t for t, _, _ in sizes) * IMAGE_TOKENS
                assert ids.count(start) == sum(t for t, _, _ in sizes)  # frame wraps too
            else:
                assert ids.count(pad) == sum(t // 2 * (h // 28) * (w // 28) for t, h, w in sizes)
            # the text and the trained labels are the sample's own, in order
            cached_ids = want["input_ids"].tolist()
            drop = {pad, img, start, tok.token_to_id("<|vision_end|>")}
            assert [x for x in ids if x not in drop] == [x for x in cached_ids if x not in drop]
            trained = [y for y in want["labels"].tolist()[1:] if y != -100]
            assert [y for y in labels if y != -100] == trained
            v += n
    # a fresh draw each epoch (of some clip), and the same draws with workers and resumed
    drawn: dict[tuple[int, str], list[list[int]]] = {}
    for b in runs:
        at = 0
        for sid, n in zip(b["id"], b["counts"], strict=True):
            drawn[(b["epoch"], sid)] = b["frames"][at : at + n]
            at += n
    assert any(drawn[(0, sid)] != drawn[(1, sid)] for sid in ("a", "b", "ab", "a2"))
    assert _run(manifest, cache_root, per_frame=per_frame, workers=2) == runs
    assert _run(manifest, cache_root, per_frame=per_frame, workers=0, resume_after=2) == runs
