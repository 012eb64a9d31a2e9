"""What mmcache's own tests and benchmarks run against, kept out of the package.

- :mod:`support.s3`: a local S3 server (moto) on 127.0.0.1, and a TCP proxy that adds
  latency and counts requests (``pip install 'mmcache[s3-server]'``);
- :mod:`support.gcs`: a local GCS server (gcp-storage-emulator)
  (``pip install 'mmcache[gcs,gcs-server]'``);
- :mod:`support.faults`: bad weather: an HTTP proxy that adds latency, answers 503s,
  drops connections, stalls or goes silent, and a plain HTTP file server.

``tests/`` is on ``sys.path`` for every test (``pythonpath`` in ``pyproject.toml``'s pytest
options), so a test in any folder imports ``from support.s3 import moto_s3``; a benchmark
puts the folder on ``sys.path`` itself. The contract suites that users' own sources,
stages and stores subclass stay public in :mod:`mmcache.testing`.
"""
