"""G22: a normal run exits without "Exception ignored" tracebacks on stderr.

Each case runs a short script in a fresh interpreter (the noise appears only while the
interpreter tears its modules down) and asserts that stderr is empty.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_LOADER_RUN = """
import sys
import mmcache
from mmcache.transforms import ImageSpec, TextSpec, train_tokenizer
from mmcache.transforms.pipeline import Pipeline
from mmcache.synth import make_dataset, synth_captions

folder = sys.argv[1]
manifest = make_dataset(folder, 16, seed=0)
train_tokenizer(synth_captions(60), vocab_size=128).save(folder + "/tok.json")
pipe = Pipeline(image=ImageSpec(size=32), text=TextSpec(folder + "/tok.json", max_length=8))
ds = mmcache.MultimodalDataset(manifest, pipeline=pipe)
cache = mmcache.Cache(folder + "/cache", memory="2MiB", disk="4MiB")  # never closed
loader = mmcache.DataLoader(ds, cache=cache, batch_size=4, num_workers=2)
for epoch in range(2):  # finished epochs: cold, then warm
    loader.set_epoch(epoch)
    for batch in loader:
        pass
loader.set_epoch(2)
for batch in loader:  # an epoch broken out of: its iterator is left to the collector
    break
it = iter(loader)
next(it)  # and one still referenced from this module at exit
print("done")
"""

_CACHE_LEFT_OPEN = """
import sys
import numpy as np
import mmcache

cache = mmcache.Cache(sys.argv[1] + "/cache", memory="1MiB", disk=None)  # never closed
cache.put(b"k" * 16, {"x": np.zeros(4)})
print("done")
"""


@pytest.mark.parametrize("script", [_LOADER_RUN, _CACHE_LEFT_OPEN], ids=["loader", "cache"])
def test_a_normal_run_exits_without_tracebacks(
    tmp_path: Path, script: str, cache_root: Path
) -> None:
    path = tmp_path / "run.py"
    path.write_text(textwrap.dedent(script))
    folder = cache_root.parent  # the fixture removes the segments of cache_root's name
    result = subprocess.run(
        [sys.executable, str(path), str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},  # warnings are not the subject
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"
    assert result.stderr == ""
