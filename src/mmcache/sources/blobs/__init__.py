"""Where a source's bytes live: local files and objects in a store, under every record
source (what a record *is* is the source's; where its bytes are is this package's).

- :mod:`.objects` objects behind fsspec (``s3://``, ``gs://``, ``http(s)://``): the one
  door to an object store, batched stamps (ETags), what an error means, offline starts;
  :mod:`.ranged` one ranged GET read no further than asked; :mod:`.retry` the retry
  policy and circuit breaker every remote call goes through; :mod:`.options` the
  ``storage_options`` (checked, redacted, the layers below told to make one attempt);
  :mod:`.listing` the last listing kept for an offline restart;
- :mod:`.raw` the raw-bytes tier: objects' bytes (whole, or spans of shards) on local disk;
- :mod:`.state` revalidated stamps handed to a source's copies in other processes;
  :mod:`.tables` the versions of a table source's remote files;
- :mod:`.blocks` fetch groups (neighbouring spans fetched with one ranged GET);
  :mod:`.tarwalk` a tar's members as spans of its bytes;
- :mod:`.prefetch` revalidating a source and fetching its misses ahead in the epoch's
  order (a loader hook).

Nothing outside this package imports fsspec: a source, the shared tier or a tool that
reads an object opens it through :class:`Remote`.
"""

from mmcache.sources.blobs.objects import Remote, RemoteError, is_remote
from mmcache.sources.blobs.raw import RawTier
from mmcache.sources.blobs.retry import RetryPolicy

__all__ = ["RawTier", "Remote", "RemoteError", "RetryPolicy", "is_remote"]
