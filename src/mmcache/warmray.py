"""``warm(dataset, cache, executor="ray")``: a shared tier filled by Ray tasks.

The samples a warm-up lacks are cut into parts and each part is one Ray task
(``num_cpus=1``) anywhere in the Ray cluster: the task opens a cache of its own with
no node tiers (no memory, no disk: a temporary root) and the same shared tier, produces
its samples through :func:`~mmcache.readthrough.read_through` (timed, encoded and
rejected as every other path does) and publishes them in packs of its own; closing its
cache commits them. Nothing but counts comes back to the driver, so no sample crosses
the Ray object store. A task that dies loses its open pack only (nothing half visible);
the next warm-up skips what was committed and produces the rest.

Ray is the optional extra ``mmcache[ray]`` (imported here only); the Ray cluster is the
one ``ray.init()`` connects to (``RAY_ADDRESS``, or a local one), unless the caller
initialised Ray already. Every task must be able to import mmcache and read the dataset
(a shared file system or an object store) and write the share.
"""

from __future__ import annotations

import functools
import math
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from mmcache.cache import Cache
from mmcache.errors import ConfigError
from mmcache.readthrough import ReadThroughSource, read_through
from mmcache.shared.tier import SharedTier

__all__ = ["warm_part", "warm_with_ray"]

#: Samples per Ray task at least (a task's start costs a fraction of a second).
MIN_PART = 16


def warm_part(
    dataset: ReadThroughSource, shared: SharedTier, indices: Sequence[int]
) -> dict[str, int]:
    """Produce the samples ``indices`` of ``dataset`` into ``shared`` (a Ray task's body,
    also callable in any process): the counts of present, admitted, refused, rejected."""
    root = tempfile.mkdtemp(prefix="mmcache-warm-part-")
    counts = {"present": 0, "admitted": 0, "refused": 0, "rejected": 0}
    try:
        with Cache(root, memory=0, disk=None, shared=shared) as cache:
            tag = dataset.fingerprint()
            for i in indices:
                key = dataset.key(i)
                if cache.contains(key):
                    counts["present"] += 1
                    continue
                got = read_through(
                    cache,
                    key,
                    functools.partial(dataset.produce, i),
                    on_error=dataset.on_error,
                    record_reject=dataset.record_reject,
                    tag=tag,
                    lookup=False,
                )
                status = "rejected" if got.rejected else "admitted" if got.admitted else "refused"
                counts[status] += 1
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return counts


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("warm(executor='ray') needs Ray: pip install 'mmcache[ray]'") from exc
    return ray


def warm_with_ray(
    dataset: ReadThroughSource,
    cache: Cache,
    todo: Sequence[int],
    *,
    progress: Callable[[int], object] | None = None,
) -> dict[str, int]:
    """Produce ``todo`` on Ray tasks into ``cache``'s shared tier (see the module
    docstring); ``progress(n)`` is told each finished part's size. The counts summed."""
    if cache.shared is None:
        raise ConfigError(
            "warm(executor='ray') fills a shared tier: give the cache one "
            "(Cache(root, shared='s3://bucket/prefix') or a shared folder)"
        )
    ray = _ray()
    if not ray.is_initialized():
        ray.init()
    cpus = max(int(ray.cluster_resources().get("CPU", 1)), 1)
    size = max(MIN_PART, math.ceil(len(todo) / (4 * cpus)))
    parts = [list(todo[i : i + size]) for i in range(0, len(todo), size)]
    task = ray.remote(num_cpus=1)(warm_part)
    shared, data = ray.put(cache.shared), ray.put(dataset)
    pending = {task.remote(data, shared, part): len(part) for part in parts}
    totals = {"present": 0, "admitted": 0, "refused": 0, "rejected": 0}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            for name, n in ray.get(ref).items():
                totals[name] += n
            if progress is not None:
                progress(pending[ref])
            del pending[ref]
    return totals
