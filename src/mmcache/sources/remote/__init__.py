"""Remote objects behind fsspec: :mod:`.fs` access, retries, batched stamps and error
classes; :mod:`.raw` the raw-bytes tier on local disk; :mod:`.prefetch` fetching a
source's misses ahead in the epoch's order (a loader hook)."""

from mmcache.sources.remote.fs import Remote, RemoteError, is_remote
from mmcache.sources.remote.raw import RawTier

__all__ = ["RawTier", "Remote", "RemoteError", "is_remote"]
