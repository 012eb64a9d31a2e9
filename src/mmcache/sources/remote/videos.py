"""``RemoteVideoSource``: video SFT records (LLaVA ``video`` or Qwen ``messages`` parts)
whose clips are objects (``s3://``, ``gs://``, ``http(s)://``), fetched once through the
raw-bytes tier and decoded from those bytes.

The manifest is read as for :class:`~mmcache.sources.files.FileSource` with a chat
pipeline (``Pipeline(text=ChatSpec(..., video=VideoTokens()), video=VideoSpec(...))``);
every video part must be a URL. When the source is opened, every clip's version stamp
(ETag) and size are taken in one batch (:meth:`Remote.stamps`, as
:class:`~mmcache.sources.remote.files.RemoteFileSource` takes its images'), so a
sample's key is made of its conversation, its parts' options and each clip's identity
and size (:func:`~mmcache.sources.remote.fs.object_identity`: an S3 ETag or a digest of
the bytes, else the URL and ETag; ``StampKind.FIXED``): an overwritten clip has a new
ETag, a new key, and its old bytes (the raw tier is keyed by URL + ETag) are never served.

Producing a sample checks each clip's listed size against the pipeline's ``max_bytes``
(its ``ImageSpec``'s, else 256 MiB) before anything is fetched, fetches each clip whole
(raw tier first: :func:`~mmcache.sources.remote.raw.fetch_bytes`, so a clip is fetched
once for all epochs, workers and jobs sharing the tier) and decodes it from memory
(:func:`~mmcache.transforms.video_decode.load_clip`); the sample is bitwise the one of
the same clip as a loose file. A missing object or one that does not decode is a
:class:`~mmcache.errors.SampleError` naming the sample and the URL.

Not here yet: records with images besides their videos (ConfigError), ``lengths()``
(packing and length grouping: it would fetch every clip's header), and revalidation of
changed objects during a run (a new source takes their new stamps).

Thread/process safety: as :class:`FileSource`; read-only after construction.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from mmcache import keys
from mmcache.errors import ConfigError, SampleError
from mmcache.sources.base import OnError, SampleSource, StampKind
from mmcache.sources.bytesproc import byte_limit, check_size
from mmcache.sources.files import FileSource
from mmcache.sources.records import Records
from mmcache.sources.remote import fs as remote_fs
from mmcache.sources.remote.fs import Offline, Remote, RemoteError, RetryPolicy, is_remote
from mmcache.sources.remote.raw import RawTier, fetch_bytes
from mmcache.sources.remote.state import private_dir

__all__ = ["RemoteVideoSource"]


class RemoteVideoSource(FileSource):
    """Video SFT samples whose clips are remote objects (see the module docstring).

    Args:
        manifest: a LLaVA JSON / JSONL or ``messages`` manifest (local), or
            :class:`Records`; every video part a URL, no images.
        pipeline: a video SFT :class:`mmcache.Pipeline` (``ChatSpec(video=...)`` and
            ``VideoSpec``).
        on_error, storage_options, raw, retries, offline, state_dir: as
            :class:`~mmcache.sources.remote.files.RemoteFileSource`.
    """

    stamp_kind: StampKind

    def __init__(
        self,
        manifest: str | os.PathLike[str] | Records,
        *,
        pipeline: Any,
        on_error: OnError = "raise",
        storage_options: Mapping[str, Any] | None = None,
        raw: RawTier | None = None,
        retries: int | RetryPolicy = 4,
        offline: Offline = "auto",
        state_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if getattr(pipeline, "video", None) is None or getattr(pipeline, "chat", None) is None:
            raise ConfigError(
                "RemoteVideoSource needs a video SFT pipeline: Pipeline(text=ChatSpec(..., "
                "video=VideoTokens()), video=VideoSpec(...))"
            )
        super().__init__(manifest, pipeline=pipeline, on_error=on_error)
        self.stamp_kind = StampKind.FIXED
        self.max_object_bytes = byte_limit(pipeline)  # clips over it are never fetched
        base = os.fspath(state_dir) if state_dir is not None else None
        if base is None:
            base = os.path.join(raw.path, "state") if raw is not None else private_dir()
        self.remote = Remote(storage_options, retries=retries, offline=offline, listing_dir=base)
        self.raw = raw
        urls: dict[str, int] = {}
        for i in range(len(self.records)):
            if self.records.image_paths(i):
                raise ConfigError(
                    f"RemoteVideoSource: record {self.records.id(i)!r} has images; only "
                    "video records are read here"
                )
            for part in self.records.videos(i):
                url = part["video"]
                if not is_remote(url):
                    raise ConfigError(
                        f"RemoteVideoSource: the video of {self.records.id(i)!r} is not a URL "
                        f"({url}); use MultimodalDataset for local files"
                    )
                urls.setdefault(url, len(urls))
        self.urls = list(urls)
        found = self.remote.stamps(self.urls) if self.urls else {}
        #: ``url -> (size, stamp)``; ``(-1, "error:<status>")`` for one that cannot be read.
        self.objects: dict[str, tuple[int, str]] = {}
        for url in self.urls:
            got = found.get(url)
            if isinstance(got, RemoteError) or got is None:
                status = got.status if isinstance(got, RemoteError) else "?"
                self.objects[url] = (-1, f"error:{status}")
            else:
                size, etag = got
                self.objects[url] = (size, etag or f"size={size}")

    # -- which sample --------------------------------------------------------------------
    def key_text(self, index: int) -> str:
        """The conversation and the video parts' options, without their URLs: each clip is
        in the key by its identity, in part order (:meth:`stamp_strings`; the URL is kept
        there only where the ETag is no identity of the bytes), so a copy of the clips
        under another bucket or prefix keeps its keys (``scope="cluster"`` with copies per
        site). With the URLs here, every copy got other keys: a miss, never wrong data."""
        parts = [{k: v for k, v in p.items() if k != "video"} for p in self.records.videos(index)]
        options = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return f"{self.records.chat_json(index)}\x00{options}"

    def _clip_stamp(self, index: int) -> str:
        parts = [self.objects[p["video"]] for p in self.records.videos(index)]
        urls = [p["video"] for p in self.records.videos(index)]
        return "|".join(
            remote_fs.object_identity(u, s, n) for u, (n, s) in zip(urls, parts, strict=True)
        )

    def stamps(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """``int64 [n, 2]``: a 63-bit digest of the sample's clips' stamps, their total size."""
        idx = self._checked(indices)
        out = np.full((idx.shape[0], 2), -2, dtype=np.int64)
        for j, i in enumerate(idx.tolist()):
            digest = keys.digest(self._clip_stamp(i))[:8]
            total = sum(self.objects[p["video"]][0] for p in self.records.videos(i))
            out[j] = (int.from_bytes(digest, "little") & ((1 << 63) - 1), total)
        return out

    def stamp_strings(
        self, indices: npt.NDArray[np.int64], stamps: npt.NDArray[np.int64]
    ) -> list[str]:
        """Each clip's identity and size (:func:`~mmcache.sources.remote.fs.object_identity`:
        the URL only where the stamp is not an identity of the bytes), as :meth:`stamps`
        digests them."""
        return [self._clip_stamp(i) for i in indices.tolist()]

    # -- produce -------------------------------------------------------------------------
    def produce(self, index: int) -> dict[str, np.ndarray]:
        """Fetch each clip of sample ``index`` (raw tier first) and make the sample from
        their bytes. Raises SampleError naming the sample and the URL."""
        self._checked([index])
        sid = self.records.id(index)
        parts = []
        for part in self.records.videos(index):
            url = part["video"]
            size, stamp = self.objects[url]
            if size < 0:
                raise SampleError(
                    f"cannot fetch {url} (HTTP {stamp.removeprefix('error:')}): the object was "
                    "not found or is not readable",
                    sample_id=sid,
                    path=url,
                )
            check_size(size, self.max_object_bytes, "video object", sample_id=sid, path=url)
            data = fetch_bytes(self.remote, self.raw, (url, stamp, 0, size), sample_id=sid)
            parts.append({**part, "video": data, "name": url, "max_bytes": self.max_object_bytes})
        out: dict[str, np.ndarray] = self.pipeline.process_chat(  # type: ignore[attr-defined]
            [], self.records.chat(index), sample_id=sid, videos=parts
        )
        return out

    def lengths(self, root: str | os.PathLike[str] | None = None) -> np.ndarray:
        """Not available yet (see the module docstring): ConfigError."""
        raise ConfigError(
            "RemoteVideoSource has no lengths() yet (packing and length grouping would "
            "fetch every clip's header): use padded batches"
        )


if TYPE_CHECKING:

    def _conforms(source: RemoteVideoSource) -> SampleSource:
        return source
