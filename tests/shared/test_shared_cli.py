"""``mmcache stats --shared URL`` and ``mmcache gc --shared URL --older-than 30d``."""

from __future__ import annotations

import json
import time

from shared_writer_child import entry, key

from mmcache.cli import main
from mmcache.shared import SharedTier
from mmcache.shared.layout import new_pack_name, pack_name

DAY = 86400.0


def publish(share, first: int, count: int, *, age: float) -> None:  # type: ignore[no-untyped-def]
    """One pack of entries ``first..first+count`` made ``age`` seconds ago."""
    tier = SharedTier(share, linger=0)
    for i in range(first, first + count):
        tier.put(key(i), entry(i), ctime=time.time() - age)
    tier.close()


def run(capsys, *argv: str) -> dict:  # type: ignore[no-untyped-def, type-arg]
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_stats_and_gc_of_a_share(tmp_path, capsys):
    share = tmp_path / "share"
    publish(share, 0, 5, age=40 * DAY)
    publish(share, 5, 3, age=0.0)
    stale = share / pack_name(new_pack_name(int((time.time() - 2 * DAY) * 1e9)))
    stale.write_bytes(b"a pack whose writer was killed before its index")
    reader = SharedTier(share, publish=False)
    assert reader.get(key(0)) == entry(0)  # merged before the gc

    stats = run(capsys, "stats", "--shared", str(share))
    assert (stats["packs"], stats["entries"], stats["uncommitted"]) == (2, 8, 1)
    assert stats["bytes"] == sum(len(entry(i)) for i in range(8))

    report = run(capsys, "gc", "--shared", str(share), "--older-than", "30d")
    assert (report["packs"], report["entries"], report["uncommitted"]) == (1, 5, 1)
    assert not stale.exists()
    stats = run(capsys, "stats", "--shared", str(share))
    assert (stats["packs"], stats["entries"], stats["uncommitted"]) == (1, 3, 0)

    # a reader that merged the removed pack misses its entries (produced again), no error
    assert reader.get(key(1)) is None
    assert reader.get(key(6)) == entry(6)
    reader.close()

    assert main(["stats", "--shared", str(share)]) == 0
    assert "1 packs, 3 entries" in capsys.readouterr().out


def test_a_share_or_a_cache_not_both(tmp_path, capsys):
    assert main(["stats", "--shared", str(tmp_path), "--cache", str(tmp_path / "c")]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["stats"]) == 2  # neither
    assert "needs --cache ROOT or --shared URL" in capsys.readouterr().err
