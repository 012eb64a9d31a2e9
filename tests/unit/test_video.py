"""Video through the cache: VideoSpec's frame indices and sizes against qwen-vl-utils' own
rules, frames against the decoder's own, damaged and oversized clips, video records,
ChatSpec's video tokens, and video SFT samples through the loader."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from chat_support import make_tokenizer
from video_support import decoded_frames, qwen_indices_and_size, run_epochs, write_clip

import mmcache
from mmcache import ChatSpec, MultimodalDataset, Pipeline, VideoSpec
from mmcache.errors import ConfigError, ManifestError, SampleError
from mmcache.loader import SFTBatching
from mmcache.sources.readers import read_manifest
from mmcache.transforms import VideoTokens
from mmcache.transforms.chat import Chat
from mmcache.transforms.video import resize_frames
from mmcache.transforms.video_decode import decode_frames, load_clip, probe, probe_source

pytest.importorskip("av")
pytest.importorskip("jinja2")

VIDEO_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<video>"]


def video_tokenizer() -> Any:
    tok = make_tokenizer()
    tok.add_special_tokens(VIDEO_SPECIALS)
    return tok


# -- the rules: equal to qwen-vl-utils' ---------------------------------------------------------

_PARTS: list[dict[str, Any]] = [
    {},
    {"fps": 1.0},
    {"fps": 4.0, "max_frames": 10},
    {"nframes": 7},
    {"nframes": 4},
    {"fps": 2.0, "min_frames": 6},
    {"video_start": 1.3, "video_end": 4.2},
    {"video_start": 0.5},
    {"video_end": 3.0, "fps": 3.0},
    {"min_pixels": 64 * 28 * 28, "max_pixels": 200 * 28 * 28},
    {"max_pixels": 50 * 28 * 28},
    {"total_pixels": 20 * 28 * 28 * 10},
]
_CLIPS = [(300, 30.0), (48, 24.0), (151, 29.97), (250, 25.0), (73, 12.5), (1200, 60.0)]
_SIZES = [(360, 640), (61, 97), (1080, 1920), (480, 270), (28, 28), (17, 1000)]


@pytest.mark.parametrize(("total", "fps"), _CLIPS)
def test_indices_and_sizes_equal_qwen_vl_utils(total: int, fps: float) -> None:
    base = VideoSpec()
    for part, (h, w) in itertools.product(_PARTS, _SIZES):
        try:
            want = qwen_indices_and_size(part, total, fps, h, w)
        except (ValueError, AssertionError):  # Qwen refuses it: so must we
            with pytest.raises(ValueError):  # a ConfigError when no clip can pass
                spec = base.for_part(part)
                n = len(spec.frame_indices(total, fps))
                spec.frame_size(h, w, nframes=n)
            continue
        spec = base.for_part(part)
        idx = spec.frame_indices(total, fps)
        assert idx == want[0], (part, total, fps)
        assert spec.frame_size(h, w, nframes=len(idx)) == want[1], (part, h, w)
        assert spec.sample_fps(total, fps) == pytest.approx(want[2], rel=1e-12)


def test_spec_fields_equal_the_message_part_form() -> None:
    assert VideoSpec(nframes=8).frame_indices(100, 25.0) == VideoSpec().for_part(
        {"nframes": 8}
    ).frame_indices(100, 25.0)
    assert (
        VideoSpec(start=1.0, end=3.0).frame_indices(100, 25.0)
        == qwen_indices_and_size({"video_start": 1.0, "video_end": 3.0}, 100, 25.0, 64, 64)[0]
    )
    with pytest.raises(ConfigError):
        VideoSpec().for_part({"fps": 1.0, "nframes": 4})
    with pytest.raises(ConfigError):
        VideoSpec(fps=0)
    assert VideoSpec().fingerprint() != VideoSpec(fps=1.0).fingerprint()
    assert VideoSpec().fingerprint() == VideoSpec().fingerprint()


# -- decoding: the decoder's own frames --------------------------------------------------------


def _clips(root: Path) -> dict[str, Path]:
    vfr = [int(i * 40 + (i % 3) * 13 + (i // 10) * 25) for i in range(40)]
    return {
        "h264_24fps": write_clip(root / "a.mp4", frames=48, fps=24, size=(64, 96)),
        "h264_30fps_gop5": write_clip(root / "b.mp4", frames=90, fps=30, size=(72, 128), gop=5),
        "h264_odd_444": write_clip(
            root / "c.mp4", frames=25, fps=25, size=(61, 97), pix_fmt="yuv444p"
        ),
        "h264_vfr": write_clip(root / "d.mp4", frames=40, fps=25, size=(64, 96), vfr_times_ms=vfr),
        "vp9_webm": write_clip(
            root / "e.webm", frames=30, fps=15, size=(48, 80), codec="libvpx-vp9"
        ),
    }


def test_frames_equal_the_decoders_own_at_the_same_indices(tmp_path: Path) -> None:
    for name, path in _clips(tmp_path).items():
        every = decoded_frames(path)
        info = probe_source(path)
        assert info.total_frames == len(every), name
        for spec in (VideoSpec(), VideoSpec(nframes=6), VideoSpec(fps=5.0, start=0.3)):
            try:
                clip = load_clip(spec, path, sample_id=name)
            except SampleError:
                continue  # a range the rules refuse (checked above against Qwen's)
            idx = spec.frame_indices(info.total_frames, info.fps)
            assert clip.indices == idx
            ref = np.stack([every[i] for i in idx]).transpose(0, 3, 1, 2)
            h, w = spec.frame_size(ref.shape[2], ref.shape[3], nframes=len(idx))
            assert clip.frames.shape == (len(idx), 3, h, w)
            # bitwise: the same decoder, the same resize rule
            np.testing.assert_array_equal(clip.frames, resize_frames(ref, (h, w)), err_msg=name)


def test_seeking_decodes_any_order_and_repeats(tmp_path: Path) -> None:
    path = write_clip(tmp_path / "g.mp4", frames=120, fps=30, size=(48, 64), gop=10)
    every = decoded_frames(path)
    import av

    wanted = [119, 3, 64, 64, 10, 0, 99]
    with av.open(str(path)) as container:
        info = probe(container)
        got = decode_frames(container, info, wanted)
    for k, i in enumerate(wanted):
        np.testing.assert_array_equal(got[k].transpose(1, 2, 0), every[i])


def test_resize_is_torchvisions_bicubic_antialias_rule() -> None:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (3, 3, 61, 97), dtype=np.uint8)
    x = torch.from_numpy(frames).float()
    # torchvision.transforms.functional.resize on a uint8 tensor: float32 interpolate,
    # clamp to [0, 255], round, back to uint8 (its _functional_tensor.resize).
    want = torch.nn.functional.interpolate(
        x, size=[56, 112], mode="bicubic", align_corners=False, antialias=True
    )
    want = want.clamp(0, 255).round().to(torch.uint8).numpy()
    np.testing.assert_array_equal(resize_frames(frames, (56, 112)), want)
    np.testing.assert_array_equal(resize_frames(frames, (61, 97)), frames)


def test_damaged_truncated_and_oversized_videos_are_sample_errors(tmp_path: Path) -> None:
    path = write_clip(tmp_path / "ok.mp4", frames=48, fps=24, size=(64, 96))
    data = path.read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: len(data) // 3])
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"\x00not a video at all" * 50)
    for bad in (cut, junk, tmp_path / "missing.mp4"):
        with pytest.raises(SampleError) as info:
            load_clip(VideoSpec(), bad, sample_id="s1")
        assert info.value.sample_id == "s1" and info.value.path == str(bad)
    with pytest.raises(SampleError, match="max_bytes") as info:
        load_clip(VideoSpec(), path, sample_id="s2", max_bytes=len(data) - 1)
    assert info.value.path == str(path)
    # bytes in memory (a shard member, an object) decode the same as the file
    a = load_clip(VideoSpec(nframes=4), path, sample_id="f")
    b = load_clip(VideoSpec(nframes=4), data, sample_id="f", name="shard.tar:ok.mp4")
    np.testing.assert_array_equal(a.frames, b.frames)
    with pytest.raises(SampleError, match="max_bytes") as info:
        load_clip(VideoSpec(), data, sample_id="s3", max_bytes=10, name="shard.tar:ok.mp4")
    assert info.value.path == "shard.tar:ok.mp4"


# -- records -------------------------------------------------------------------------------------


def _write(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def test_llava_and_messages_video_records(tmp_path: Path) -> None:
    m = _write(
        tmp_path / "m.json",
        [
            {
                "id": "llava",
                "video": "clips/a.mp4",
                "conversations": [
                    {"from": "human", "value": "<video>\nWhat happens?"},
                    {"from": "gpt", "value": "A square moves."},
                ],
            },
            {
                "id": "qwen",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "video", "video": "file:///data/b.mp4", "fps": 1.0,
                             "max_pixels": 360 * 420, "video_start": 0.5, "video_end": 2.0},
                            {"type": "text", "text": "Describe."},
                        ],
                    },
                    {"role": "assistant", "content": "Colours change."},
                ],
            },
            {"id": "two", "video": ["x.mp4", "y.webm"], "conversations": [
                {"from": "human", "value": "<video> vs <video>"}, {"from": "gpt", "value": "."}]},
        ],
    )  # fmt: skip
    rec = read_manifest(m)
    assert rec.videos(0) == [{"video": str(tmp_path / "clips/a.mp4")}]
    assert rec.videos(1) == [
        {"video": "/data/b.mp4", "fps": 1.0, "max_pixels": 360 * 420, "video_start": 0.5,
         "video_end": 2.0}
    ]  # fmt: skip
    assert rec.chat(1)[0] == ("user", "<video>Describe.")
    assert [p["video"] for p in rec.videos(2)] == [
        str(tmp_path / "x.mp4"),
        str(tmp_path / "y.webm"),
    ]
    assert rec.video_counts().tolist() == [1, 1, 2]
    assert rec.select([2, 0], []).videos(0) == rec.videos(2)


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"video": "a.mp4", "conversations": [{"from": "human", "value": "no tag"},
                                              {"from": "gpt", "value": "x"}]},
         "0 '<video>' placeholders for 1 videos"),
        ({"video": "a.mp4", "conversations": [{"from": "human", "value": "<video><video>"},
                                              {"from": "gpt", "value": "x"}]},
         "2 '<video>' placeholders for 1 videos"),
        ({"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4",
                                                     "fps": 1, "nframes": 4}]}]},
         "'fps' or 'nframes'"),
        ({"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4",
                                                     "fps": "fast"}]}]},
         "'fps' must be a number"),
        ({"video": 3, "conversations": [{"from": "human", "value": "<video>"}]},
         "'video' must be a non-empty string"),
    ],
)  # fmt: skip
def test_bad_video_records_are_manifest_errors(
    tmp_path: Path, record: dict[str, Any], reason: str
) -> None:
    m = _write(tmp_path / "m.json", [{"id": "bad", **record}])
    with pytest.raises(ManifestError, match=reason) as info:
        read_manifest(m)
    assert info.value.line == 1 and info.value.sample_id == "bad"
    ok = {"id": "ok", "conversations": [{"from": "human", "value": "hi"},
                                        {"from": "gpt", "value": "x"}]}  # fmt: skip
    m = _write(tmp_path / "m2.json", [{"id": "bad", **record}, ok])
    skipped = read_manifest(m, on_error="skip")
    assert len(skipped) == 1 and reason.split("'", 1)[0] in skipped.rejects[0].reason


# -- ChatSpec: video tokens -----------------------------------------------------------------------


def test_qwen_video_tokens_and_llava_video_per_frame_runs() -> None:
    tok = video_tokenizer()
    spec = ChatSpec(tok, "chatml", 4096, video=VideoTokens())
    chat = Chat((("user", "<video>\nWhat?"), ("assistant", "A cat.")), (), ((8, 56, 84),))
    enc = spec.encode(chat)
    pad = tok.token_to_id("<|video_pad|>")
    start, end = tok.token_to_id("<|vision_start|>"), tok.token_to_id("<|vision_end|>")
    ids = enc.input_ids.tolist()
    n = 8 // 2 * (56 // 28) * (84 // 28)
    assert ids.count(pad) == n == VideoSpec().video_tokens(8, 56, 84)
    first = ids.index(pad)
    assert ids[first - 1] == start and ids[first + n] == end
    assert (enc.labels[first - 1 : first + n + 1] == -100).all()
    assert enc.n_videos == 1 and enc.trainable > 0
    # LLaVA-Video: each frame an image run of the spec's image token
    per = ChatSpec(tok, "chatml", 4096, image_tokens=5, video=VideoTokens(per_frame=True))
    enc = per.encode(chat)
    assert enc.input_ids.tolist().count(tok.token_to_id("<image>")) == 8 * 5
    # truncation never cuts a video: the sample ends before it (here: nothing left)
    short = ChatSpec(tok, "chatml", 30, video=VideoTokens())
    long_chat = Chat(
        (("user", "Hi"), ("assistant", "Hello there."), ("user", "<video>"), ("assistant", "Ok")),
        (),
        ((8, 56, 84),),
    )
    enc = short.encode(long_chat)
    assert enc.n_videos == 0 and pad not in enc.input_ids.tolist() and enc.truncated
    with pytest.raises(SampleError, match="placeholders"):
        spec.encode(Chat((("user", "<video>"), ("assistant", "x")), (), ()))
    plain = ChatSpec(tok, "chatml", 4096)
    with pytest.raises(SampleError, match="video="):
        plain.encode(Chat((("user", "hi"), ("assistant", "x")), (), ((2, 28, 28),)))
    # without video= the fingerprint is the one a ChatSpec always had
    assert spec.fingerprint() != plain.fingerprint()
    assert plain.fingerprint() == ChatSpec(tok, "chatml", 4096).fingerprint()


# -- samples and batches ----------------------------------------------------------------------


def video_pipeline(max_length: int = 4096, **spec: Any) -> Pipeline:
    return Pipeline(
        text=ChatSpec(video_tokenizer(), "chatml", max_length, video=VideoTokens()),
        video=VideoSpec(**spec),
    )


@pytest.fixture
def video_manifest(tmp_path: Path) -> Path:
    write_clip(tmp_path / "v/a.mp4", frames=48, fps=24, size=(64, 96))
    write_clip(tmp_path / "v/b.mp4", frames=75, fps=25, size=(72, 128))
    write_clip(tmp_path / "v/c.webm", frames=30, fps=15, size=(48, 80), codec="libvpx-vp9")
    ask = [
        {"from": "human", "value": "<video>\nWhat happens?"},
        {"from": "gpt", "value": "It moves."},
    ]
    return _write(
        tmp_path / "m.json",
        [
            {"id": "a", "video": "v/a.mp4", "conversations": ask},
            {"id": "b", "messages": [
                {"role": "user", "content": [{"type": "video", "video": "v/b.mp4", "nframes": 6},
                                             {"type": "text", "text": "Describe."}]},
                {"role": "assistant", "content": "Colours."}]},
            {"id": "c", "video": ["v/c.webm", "v/a.mp4"], "conversations": [
                {"from": "human", "value": "<video> then <video>"},
                {"from": "gpt", "value": "Two."}]},
        ],
    )  # fmt: skip


def test_sample_fields_and_keys(video_manifest: Path) -> None:
    ds = MultimodalDataset(
        video_manifest, pipeline=video_pipeline(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
    )
    s = ds.produce(1)
    (t, h, w) = s["video_sizes"][0].tolist()
    spec = VideoSpec(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28).for_part({"nframes": 6})
    assert t == 6 and (h, w) == spec.frame_size(72, 128, nframes=6)
    assert s["videos"].dtype == np.uint8 and s["videos"].size == t * 3 * h * w
    assert s["video_grid_thw"].tolist() == [[3, h // 14, w // 14]]
    assert s["second_per_grid_ts"][0] == pytest.approx(2 / (6 / 75 * 25))
    pad = video_tokenizer().token_to_id("<|video_pad|>")
    assert int((s["input_ids"] == pad).sum()) == spec.video_tokens(t, h, w)
    two = ds.produce(2)
    assert two["video_sizes"].shape == (2, 3)
    # the key follows the video file and the part's options
    key = ds.key(0)
    clip = video_manifest.parent / "v/a.mp4"
    data = clip.read_bytes()
    write_clip(clip, frames=48, fps=24, size=(64, 96), gop=6)
    assert clip.read_bytes() != data
    assert MultimodalDataset(video_manifest, pipeline=ds.pipeline).key(0) != key
    other = MultimodalDataset(video_manifest, pipeline=video_pipeline(fps=1.0))
    assert other.key(0) != ds.key(0)


def test_loader_batches_list_variable_clips(video_manifest: Path, cache_root: Path) -> None:
    ds = MultimodalDataset(
        video_manifest, pipeline=video_pipeline(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
    )
    produced = [ds.produce(i) for i in range(3)]
    cache = mmcache.Cache(cache_root, memory="64MiB", disk="128MiB")
    try:
        loader = mmcache.DataLoader(ds, cache=cache, batch_size=3, shuffle=False)
        for epoch in range(2):  # cold, then from the cache
            (batch,) = list(loader)
            assert batch["video_counts"].tolist() == [1, 1, 2]
            sizes = np.concatenate([p["video_sizes"] for p in produced])
            np.testing.assert_array_equal(batch["video_sizes"].numpy(), sizes)
            clips = batch["videos"]
            assert isinstance(clips, list) and len(clips) == 4
            flat = np.concatenate([p["videos"] for p in produced])
            np.testing.assert_array_equal(np.concatenate([c.numpy().ravel() for c in clips]), flat)
            for c, (t, h, w) in zip(clips, sizes.tolist(), strict=True):
                assert tuple(c.shape) == (t, 3, h, w)
            np.testing.assert_array_equal(
                batch["video_grid_thw"].numpy(),
                np.concatenate([p["video_grid_thw"] for p in produced]),
            )
            assert batch["second_per_grid_ts"].shape == (4,)
            if epoch:
                assert loader.stats().hits >= 3
    finally:
        cache.close()


def test_lengths_count_video_tokens_without_decoding_and_packing_holds(
    video_manifest: Path, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe = video_pipeline(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
    ds = MultimodalDataset(video_manifest, pipeline=pipe)
    produced = [len(ds.produce(i)["input_ids"]) for i in range(3)]
    import mmcache.transforms.video_decode as vd

    def no_decode(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("lengths() decoded a frame")

    monkeypatch.setattr(vd, "decode_frames", no_decode)
    fresh = MultimodalDataset(video_manifest, pipeline=pipe)
    assert fresh.lengths().tolist() == produced
    monkeypatch.undo()
    cache = mmcache.Cache(cache_root, memory="64MiB", disk="128MiB")
    try:
        loader = mmcache.DataLoader(
            fresh,
            cache=cache,
            batch_size=1,
            batching=SFTBatching(pack=mmcache.PackSpec(max_tokens=max(produced) * 2)),
        )
        seen = []
        for batch in loader:
            assert batch["input_ids"].shape[1] <= max(produced) * 2
            assert int(batch["video_counts"].sum()) == len(batch["video_grid_thw"])
            seen.extend(batch["id"])
        assert sorted(seen) == ["a", "b", "c"]
    finally:
        cache.close()


def _sampled_run(
    manifest: Path, root: Path, *, workers: int, resume_after: int | None = None
) -> list[tuple[int, str, list[list[int]], list[int]]]:
    """(epoch, id, each video's frame bytes digest, input_ids) of every row of two epochs,
    batch size 1, optionally stopped after ``resume_after`` batches and resumed."""
    from mmcache.loader.video_frames import VideoFrameSampler

    pipe = video_pipeline(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
    ds = MultimodalDataset(manifest, pipeline=pipe)
    hook = VideoFrameSampler(
        2,
        video_token_id=pipe.chat.video_token_id,
        pad_token_id=ds.pad_token_id,  # type: ignore[union-attr, arg-type]
    )
    cache = mmcache.Cache(root, memory="64MiB", disk="128MiB")
    try:

        def make() -> mmcache.DataLoader:
            return mmcache.DataLoader(ds, cache=cache, batch_size=1, shuffle=True, seed=3,
                                      num_workers=workers, hooks=[hook])  # fmt: skip

        def record(epoch: int, batch: dict[str, Any]) -> tuple[Any, ...]:
            frames = [[int(f.sum()) for f in c] for c in batch["videos"]]
            ids = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
            return (epoch, batch["id"][0], frames, ids)

        out = run_epochs(make, record, resume_after=resume_after)
    finally:
        cache.close()
    return out


def test_frame_sampling_after_the_cache_is_seeded_exact_on_resume_and_any_workers(
    video_manifest: Path, cache_root: Path
) -> None:
    plain = _sampled_run(video_manifest, cache_root, workers=0)  # cold, then warm below
    assert len(plain) == 6
    assert _sampled_run(video_manifest, cache_root, workers=2) == plain
    assert _sampled_run(video_manifest, cache_root, workers=0, resume_after=4) == plain
    pad = video_tokenizer().token_to_id("<|video_pad|>")
    by_epoch = {(e, i): (f, ids) for e, i, f, ids in plain}
    for frames, _ in by_epoch.values():
        assert all(len(f) == 2 for f in frames)  # 2 frames kept of each clip
    s = MultimodalDataset(
        video_manifest, pipeline=video_pipeline(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
    )
    # the video token runs shrank to the kept frames: 1 grid step per clip
    sample = s.produce(s.records.index_of("b"))
    _, h, w = sample["video_sizes"][0].tolist()
    assert by_epoch[(0, "b")][1].count(pad) == (h // 28) * (w // 28)
    # a fresh draw each epoch (the 6- and 12-frame clips)
    assert any(by_epoch[(0, i)][0] != by_epoch[(1, i)][0] for i in ("a", "b", "c"))
