"""Sample sources: where samples come from (see :mod:`mmcache.sources.base`)."""
