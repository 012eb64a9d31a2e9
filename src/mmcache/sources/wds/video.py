"""Video members of WebDataset shards: a sample whose media member is a clip
(``key.mp4``, ``.webm``, ``.mkv``, ``.avi``, ``.mov``) and whose text member is its
caption, as video-caption shards (WebVid, Panda-70M style) hold them.

The clip's bytes (read by the source after its tar header's size was checked against
the member limit, so an oversized member is never read) are decoded from memory by
:func:`~mmcache.transforms.video_decode.load_clip` (PyAV, seeking to the kept frames,
bounded by the same limit); the caption becomes the one-turn conversation
``user: <video>``, ``assistant: caption`` (the video placeholder of the pipeline's
``ChatSpec(video=VideoTokens(...))``) and the sample is made by
:meth:`mmcache.Pipeline.process_chat`, so it is bitwise the sample of the same clip and
that conversation as a loose file in a LLaVA manifest. A damaged or truncated member is
a :class:`~mmcache.errors.SampleError` naming the shard and the member
(``shard.tar:key.mp4``).

Pure functions; thread-safe.
"""

from __future__ import annotations

import numpy as np

from mmcache.errors import SampleError
from mmcache.transforms.pipeline import Pipeline, StagedProcessor

__all__ = ["VIDEO_EXTS", "is_video_member", "produce_video"]

#: Member extensions of video clips, in order of preference when a key has several.
VIDEO_EXTS = ("mp4", "webm", "mkv", "avi", "mov")


def is_video_member(name: str, video_exts: tuple[str, ...]) -> bool:
    """Whether the member ``name`` (``key.ext``) is a clip."""
    return name.rsplit(".", 1)[-1].lower() in video_exts


def produce_video(
    pipeline: StagedProcessor,
    data: bytes,
    caption: str | None,
    *,
    sample_id: str,
    path: str,
    max_bytes: int | None,
) -> dict[str, np.ndarray]:
    """The SFT sample of one clip's bytes and its caption (see the module docstring).
    SampleError naming ``sample_id`` and ``path`` when the pipeline makes no video
    samples, the caption is missing, or the clip does not decode."""
    chat = pipeline.chat if isinstance(pipeline, Pipeline) else None
    video = None if chat is None else chat.video
    if (
        not isinstance(pipeline, Pipeline)
        or chat is None
        or video is None
        or pipeline.video is None
    ):
        raise SampleError(
            "a video member needs a video SFT pipeline: Pipeline(text=ChatSpec(..., "
            "video=VideoTokens()), video=VideoSpec(...))",
            sample_id=sample_id,
            path=path,
        )
    if caption is None:
        raise SampleError("the video has no text member (its caption)", sample_id=sample_id,
                          path=path)  # fmt: skip
    messages = [("user", video.placeholder), ("assistant", caption)]
    part = {"video": data, "name": path, "max_bytes": max_bytes}
    out: dict[str, np.ndarray] = pipeline.process_chat(
        [], messages, sample_id=sample_id, videos=[part]
    )
    return out
