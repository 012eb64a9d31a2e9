"""What tests of mmcache and of its extensions use (the extension face's test kit).

Each submodule is imported on its own, since each needs its own optional packages
(``mmcache[testing]``: pytest and hypothesis; ``mmcache[s3-server]``, ``[gcs-server]``):

- :mod:`~mmcache.testing.source_contract`, :mod:`~mmcache.testing.stage_contract`,
  :mod:`~mmcache.testing.store_contract`, :mod:`~mmcache.testing.store_machine`: the
  contract suites a new source, stage or tier subclasses;
- :mod:`~mmcache.testing.s3`, :mod:`~mmcache.testing.gcs`: local S3 and GCS servers on
  127.0.0.1 and a proxy adding latency;
- :mod:`~mmcache.testing.tabular`, :mod:`~mmcache.testing.sft`: the same samples as
  Parquet, HF datasets and COCO files; synthetic SFT samples;
- :mod:`~mmcache.testing.spawned`: a spawned worker process for pickling checks.
"""

__all__ = [
    "gcs",
    "s3",
    "sft",
    "source_contract",
    "spawned",
    "stage_contract",
    "store_contract",
    "store_machine",
    "tabular",
]
