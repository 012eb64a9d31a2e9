"""Jobs sharing a root count what they decoded apart from what they waited for (issue 37,
item 12).

Two jobs with the same order on one root miss the same keys at once; the production
claims (:mod:`mmcache.stores.claims`) make one decode each sample while the other waits
for it. A sample a job waited for used to be counted as a hit (of the memory tier,
where the other job put it): a cold epoch of three jobs read as one-third cold. Now
``misses`` is what the job decoded, ``waited`` what another job decoded for it, and
``hits`` what the cache held when asked.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from mmcache.cacheroot import memory_name
from mmcache.stores.memory import unlink_store

N = 16

# One job: waits for the go file, runs a cold epoch whose decodes take 40 ms (each
# recorded in its own file), prints its epoch's counts and the decodes it made.
JOB = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from mmcache import Cache, DataLoader, MultimodalDataset
    from mmcache.transforms import ImageSpec
    from mmcache.transforms.pipeline import Pipeline
    manifest, root, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    ds = MultimodalDataset(manifest, pipeline=Pipeline(image=ImageSpec(size=32)))
    decoded = []
    produce = ds.produce
    def slow(index):
        decoded.append(index)
        time.sleep(0.04)
        return produce(index)
    ds.produce = slow
    loader = DataLoader(ds, cache=Cache(root, memory="4MiB", disk=None), batch_size=4, seed=7)
    Path(f"{go}.{os.getpid()}").touch()
    while not go.exists():
        time.sleep(0.002)
    list(loader)
    e = loader.stats().epochs[0]
    print(json.dumps({"hits": e.hits, "misses": e.misses, "waited": e.waited,
                      "tier_hits": e.tier_hits, "decoded": len(decoded)}), flush=True)
    """
)


def test_samples_another_job_decoded_are_counted_as_waited_not_as_hits_or_misses(
    tmp_path: Path,
) -> None:
    from mmcache.synth import make_dataset

    manifest = make_dataset(tmp_path / "data", N, seed=6)
    root, go = tmp_path / "cache", tmp_path / "go"
    argv = [sys.executable, "-c", JOB, str(manifest), str(root), str(go)]
    jobs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("go.*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        go.touch()  # both start their epoch at once, in the same order
        counts = []
        for job in jobs:
            out, _ = job.communicate(timeout=180)
            assert job.returncode == 0
            counts.append(json.loads(out))
    finally:
        for job in jobs:
            job.kill()
            job.wait()
        unlink_store(memory_name(root))
    assert sum(c["decoded"] for c in counts) == N  # one decode per sample on the node
    for mine, other in (counts, counts[::-1]):
        assert mine["misses"] == mine["decoded"], counts  # misses: what this job decoded
        assert mine["hits"] + mine["misses"] + mine["waited"] == N, counts
        assert mine["waited"] <= other["decoded"], counts
        assert sum(mine["tier_hits"].values()) == mine["hits"], counts
    assert sum(c["waited"] for c in counts) > 0, counts  # they did wait for each other
