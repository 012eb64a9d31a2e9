"""Processing stages: the deterministic steps a cache holds the result of (see
:mod:`mmcache.transforms.stage`)."""
