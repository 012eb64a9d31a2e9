"""What a cache root records about itself: ``cache.json``, its identity, and the name of
its memory tier.

A root is a folder: its disk tier (``disk/``), its fingerprint registry
(``fingerprints/``), ``cache.json``, the budgets, policy and TTL its owner
gave, so that the CLI (``stats``, ``verify``, ``gc``, ``warm``) can reopen it
without being told them again, and ``root-id``, a random number made with the
root (:func:`root_id`). Its memory tier lives in ``/dev/shm`` under a name
derived from the root's path *and* that identity: a root removed (``rm -rf``) and
made again at the same path is another root, whose memory tier starts empty; the
old one is never adopted, and is reclaimed once nobody uses it (the memory store
records the identity it was made for). Rejected: the path alone (the old tier
served a removed root's entries to the new one: a "cold" run was warm); the
root folder's inode (reused at once by ``rmdir`` + ``mkdir`` on tmpfs and ext4).
The files are untrusted input like every cache file: plain JSON or 16 hex digits,
validated here, never executed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from mmcache.codec.compact import parse_disk_form
from mmcache.dist import NODE_ENV
from mmcache.errors import CacheError, ConfigError
from mmcache.policies import policy_names
from mmcache.rootfiles import ROOT_ID_FILE, create_file, read_root_id, replace_file
from mmcache.units import parse_duration, parse_size

__all__ = [
    "CONFIG_FILE",
    "memory_group",
    "memory_name",
    "read_config",
    "root_id",
    "write_config",
]

logger = logging.getLogger(__name__)

#: Budgets of a cache root, written beside its disk tier (see Cache.open_existing).
CONFIG_FILE = "cache.json"


def root_id(root: Path, *, mode: int, create: bool) -> int:
    """The identity of the cache root ``root``: the random number in ``root/root-id``,
    or 0 when it has none.

    ``create``: a root without one gets one now (a new root, or one made before
    roots had an identity: once, for good), written with ``mode`` so that every
    member of a shared root reads the same; of processes opening a new root at once
    exactly one creates it and all read that one (:func:`mmcache.rootfiles.create_file`).
    0 (the memory tier is then named from the path alone, as before identities)
    when not ``create`` and there is none, or when it cannot be made or read (a
    read-only root, a planted link or FIFO, garbage: a warning names the file).
    Process-safe.
    """
    path = root / ROOT_ID_FILE
    if not root.is_dir():
        return 0  # no root folder (it could not be made: the tiers say why)
    for _ in range(2):  # read; else create; else read the one another process made
        try:
            found = read_root_id(root)
        except FileNotFoundError:
            return 0  # the root folder went meanwhile
        except (OSError, CacheError) as exc:
            logger.warning(
                "cannot read the identity of cache root %s (%s); its memory tier is named "
                "from its path alone, so a root made again at this path would adopt it",
                root, exc,
            )  # fmt: skip
            return 0
        if found is not None or not create:
            return found or 0
        made = secrets.randbelow((1 << 63) - 1) + 1
        try:
            if create_file(path, f"{made:016x}\n".encode(), mode):
                return made
        except OSError as exc:
            logger.debug("cannot record the identity of cache root %s: %s", root, exc)
            return 0
    return 0  # pragma: no cover - made and removed between our two reads


def memory_name(root: Path, identity: int | None = None) -> str:
    """Name of the memory tier of ``root``: a hash, never the path itself.

    ``identity``: the root's (:func:`root_id`, 0: none); None reads the one ``root``
    has now (creating none). It is hashed in, so a root made again at the same path
    gets another memory tier (see the module docstring); a root without one keeps
    the name from its path alone. No uid in it: the store's directory says whose it
    is (``/dev/shm/mmcache-u<uid>/``, or ``mmcache-g<gid>/`` shared by a group, where
    every member must find one name: each reads the root's one identity). With
    ``$MMCACHE_NODE`` set the node's name is hashed in too, so that several "nodes"
    on one machine (``scope="cluster"`` tests) never share a memory tier.
    """
    if identity is None:
        identity = root_id(root, mode=0o600, create=False)
    text = str(root) if not identity else f"{root}\0root={identity:016x}"
    node = os.environ.get(NODE_ENV)
    if node:
        text = f"{text}\0node={node}"
    return xxhash.xxh3_64_hexdigest(text.encode())


def memory_group(root: Path, mode: int) -> int | None:
    """The group sharing the memory tier: the root's, when ``mode`` opens it to a group."""
    if not mode & 0o060:
        return None
    try:
        return os.stat(root).st_gid
    except OSError:
        return os.getegid()


def read_config(root: str | os.PathLike[str]) -> dict[str, Any]:
    """The options recorded in ``root/cache.json``, validated: ``memory``, ``disk``,
    ``policy``, ``ttl`` and ``disk_form`` (the form the root was last opened with, so
    that stats, verify and gc open that form's folder), as :class:`~mmcache.cache.Cache`
    takes them.

    Every command that reopens a root (``Cache.open_existing``: stats, verify, gc,
    warm) reads the file here, so a hand-edited value is refused the same way by
    all of them, also where an override (``memory=0``) means it would not be used.
    An unknown policy name reads as ``value`` (policies are plug-ins: the one that
    wrote it may not be registered in this process). Raises CacheError when the
    file is missing or unreadable, ConfigError naming the file, key and value
    when a value is not valid.
    """
    path = Path(os.path.expanduser(os.fspath(root))) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CacheError(
            f"{path} not found: {root} is not an mmcache cache root (no disk tier was made)"
        ) from exc
    except (OSError, ValueError) as exc:
        raise CacheError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict) or config.get("format") != 1:
        raise CacheError(f"{path}: unknown cache config format")

    def finite_duration(value: Any) -> float:
        seconds = parse_duration(value)
        if not math.isfinite(seconds):
            raise ConfigError(f"duration must be a finite number of seconds, got {value!r}")
        return seconds

    checks: dict[str, Callable[[Any], object]] = {
        "memory": lambda v: v == "auto" or parse_size(v),
        "disk": lambda v: v is None or parse_size(v),
        "ttl": lambda v: v is None or finite_duration(v),
        "disk_form": parse_disk_form,
    }
    options = {
        "memory": config.get("memory", 0),
        "disk": config.get("disk"),
        "ttl": config.get("ttl"),
        "disk_form": config.get("disk_form", "raw"),  # older roots: the raw form
    }
    for name, check in checks.items():
        try:
            check(options[name])
        except ConfigError as exc:
            raise ConfigError(
                f"{path}: {name!r} is {options[name]!r}, which is not valid ({exc}); correct "
                "it, or open the root once with Cache(root, memory=..., disk=...) to record "
                "new budgets"
            ) from exc
    policy = config.get("policy", "value")
    options["policy"] = policy if policy in policy_names() else "value"
    return options


def write_config(
    root: Path, config: dict[str, Any], *, mode: int, changes: dict[str, Any] | None = None
) -> None:
    """Record the options in ``root/cache.json`` so the CLI can reopen the root.

    Without ``changes``: ``config`` (``memory``, ``disk``, ``policy``, ``ttl``), the
    options of a caller creating or configuring a cache. With ``changes``
    (``gc(max_size=...)``, ``warm --disk``): only those fields change in the
    recorded file (``config`` stands in for an unreadable one), so the overrides
    of a reopening (``memory=0``, a TTL) are never persisted. Written atomically
    (a temp file of a random name + rename, :func:`mmcache.rootfiles.replace_file`)
    with ``mode``; plain JSON, never executed.
    """
    path = root / CONFIG_FILE
    out: dict[str, Any] = {"format": 1, **config}
    if changes:
        try:
            recorded = json.loads(path.read_text())
        except (OSError, ValueError):
            recorded = None
        if isinstance(recorded, dict) and recorded.get("format") == 1:
            out = recorded
        out.update(changes)
    try:  # never through a link a member of a shared root planted (rootfiles)
        replace_file(path, json.dumps(out, indent=1).encode(), mode)
    except OSError as exc:  # read-only root: the config is a convenience
        logger.debug("cannot write %s: %s", path, exc)
