"""Remote objects behind fsspec: :mod:`.fs` access, batched stamps and error classes;
:mod:`.ranged` one ranged GET read no further than asked; :mod:`.retry` the retry policy
and circuit breaker; :mod:`.raw` the raw-bytes tier on local disk; :mod:`.tables` the
versions of a table source's remote files; :mod:`.prefetch` revalidating a source and
fetching its misses ahead in the epoch's order (a loader hook)."""

from mmcache.sources.remote.fs import Remote, RemoteError, is_remote
from mmcache.sources.remote.raw import RawTier
from mmcache.sources.remote.retry import RetryPolicy

__all__ = ["RawTier", "Remote", "RemoteError", "RetryPolicy", "is_remote"]
