"""The shared tier: prepared entries on a shared file system or an object store, read
by every node, job and later run before it produces (``Cache(root, shared=...)``).

- :mod:`~mmcache.shared.layout` what a share holds: packs and their indexes, byte for byte;
- :mod:`~mmcache.shared.index` the merged index of a share in one process (columns);
- :mod:`~mmcache.shared.access` its I/O through :mod:`mmcache.sources.blobs`, under the
  remote retry policy;
- :mod:`~mmcache.shared.writer` publishing: packs spooled, uploaded, indexes committed;
- :mod:`~mmcache.shared.tier` :class:`SharedTier`, the store;
- :mod:`~mmcache.shared.maintenance` ``mmcache gc --shared`` and ``mmcache stats --shared``.
"""

from mmcache.shared.tier import SharedTier

__all__ = ["SharedTier"]
