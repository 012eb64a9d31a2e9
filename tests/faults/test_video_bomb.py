"""A video decompression bomb: a clip of a few KB whose kept frames are 1080p. Black
H.264 frames compress to a few hundred bytes each, and ``VideoSpec()`` (2 frames a
second) keeps every frame of a 2 fps clip, so 64 of them decode to 64 x 6 MiB of RGB.
Decoding them all at the source size, then stacking and resizing the stack, took over
3 GiB for this clip (7.4 GB for 400 frames); frames resized as they are decoded cost the
output (64 x 560 x 1008 x 3 bytes, 104 MiB) plus one source frame. Measured in a child
process, as a loose file's sample and as a WebDataset member's (the clip's bytes): the
paths the loaders and the S3 source take to ``load_clip``."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")
pytest.importorskip("jinja2")

FRAMES = 64
BOMB_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    sys.path.insert(0, sys.argv[1])
    from chat_support import make_tokenizer
    from mmcache import ChatSpec, ImageSpec, Pipeline, VideoSpec
    from mmcache.sources.wds import WebDatasetSource
    from mmcache.transforms import VideoTokens

    clip, shard = sys.argv[2:4]
    tok = make_tokenizer()
    tok.add_special_tokens(["<|vision_start|>", "<|vision_end|>", "<|video_pad|>", "<video>"])
    pipe = Pipeline(image=ImageSpec(size=28),
                    text=ChatSpec(tok, "chatml", 1 << 16, video=VideoTokens()),
                    video=VideoSpec())
    turns = [("user", "<video>"), ("assistant", "Black.")]
    loose = pipe.process_chat([], turns, sample_id="bomb", videos=[{"video": clip}])
    member = WebDatasetSource(shard, pipeline=pipe, index_dir=False).produce(0)
    print(json.dumps({
        "sizes": [loose["video_sizes"].tolist(), member["video_sizes"].tolist()],
        "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }))
    """
)


def write_black_clip(path: Path, *, frames: int, size: tuple[int, int], fps: int) -> Path:
    """``frames`` black frames of ``size`` (h, w), H.264 at ``fps``: a few KB."""
    height, width = size
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast", "g": "250"}
        black = av.VideoFrame.from_ndarray(np.zeros((height, width, 3), np.uint8), "rgb24")
        black = black.reformat(format="yuv420p")
        for i in range(frames):
            black.pts = i
            for packet in stream.encode(black):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux only")
def test_a_clip_of_black_1080p_frames_decodes_within_2_gib(tmp_path: Path) -> None:
    clip = write_black_clip(tmp_path / "bomb.mp4", frames=FRAMES, size=(1080, 1920), fps=2)
    data = clip.read_bytes()
    assert len(data) < 64 << 10  # a few KB that decode to 64 x 1920 x 1080 x 3 bytes
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, body in (("bomb.mp4", data), ("bomb.txt", b"Black.")):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    helpers = str(Path(__file__).parent.parent / "unit")
    proc = subprocess.run(
        [sys.executable, "-c", BOMB_SCRIPT, helpers, str(clip), str(shard)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # served, every frame kept, at VideoSpec()'s size for 64 frames
    assert result["sizes"] == [[[FRAMES, 560, 1008]]] * 2
    peak_mib = result["peak_rss_kib"] >> 10
    assert peak_mib < 2048, f"peak RSS {peak_mib} MiB decoding {FRAMES} 1080p frames"
