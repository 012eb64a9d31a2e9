"""A writer of a share in its own process (``python shared_writer_child.py SHARE SPOOL
FIRST COUNT [REPEAT]``): publishes entries ``FIRST..FIRST+COUNT`` (see :func:`entry`) in
packs of 16 KiB, prints ``ready`` once the first pack is committed, and repeats the
whole run ``REPEAT`` times (0: forever; the tests kill it). ``SHARE_OPTIONS`` in the
environment: the share's ``storage_options`` as JSON (an S3 server's)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from mmcache import codec
from mmcache.shared import SharedTier


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def entry(i: int) -> bytes:
    """Entry ``i``: a codec entry of pseudo-random bytes, 1-6 KiB."""
    rng = np.random.default_rng(i)
    n = int(rng.integers(1024, 6144))
    return codec.encode({"x": rng.integers(0, 256, n, dtype=np.uint8)}, ctime=1.0 + i)


def main() -> None:
    share, spool, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    repeat = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    options = json.loads(os.environ.get("SHARE_OPTIONS", "{}"))
    tier = SharedTier(
        share, storage_options=options, pack_bytes=16 << 10, linger=0, spool_dir=spool
    )
    told = False
    run = 0
    while repeat == 0 or run < repeat:
        run += 1
        for i in range(first, first + count):
            tier.put(key(i), entry(i), ctime=1.0 + i)
            if not told and tier._writer is not None and tier._writer.published:
                print("ready", flush=True)
                told = True
    tier.close()
    print("done", flush=True)


if __name__ == "__main__":
    main()
