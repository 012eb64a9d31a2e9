"""What tests of mmcache's extensions use (the extension face's test kit).

Each submodule is imported on its own, since each needs its own optional packages
(``mmcache[testing]``: pytest and hypothesis):

- :mod:`~mmcache.testing.source_contract`, :mod:`~mmcache.testing.stage_contract`,
  :mod:`~mmcache.testing.store_contract`, :mod:`~mmcache.testing.store_machine`,
  :mod:`~mmcache.testing.identity_contract`: the contract suites a new source, stage
  or tier subclasses;
- :mod:`~mmcache.testing.tabular`, :mod:`~mmcache.testing.sft`: the same samples as
  Parquet, HF datasets and COCO files; synthetic SFT samples;
- :mod:`~mmcache.testing.spawned`: a spawned worker process for pickling checks.

The local S3 and GCS servers and the fault proxies mmcache's own tests run against
live in the repository's ``tests/support/``, not here.
"""

__all__ = [
    "identity_contract",
    "sft",
    "source_contract",
    "spawned",
    "stage_contract",
    "store_contract",
    "store_machine",
    "tabular",
]
